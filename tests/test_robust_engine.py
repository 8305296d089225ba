"""Bad inputs against the engine and the in-process server: each gets a clear 4xx error of the contract's
shape, fails no other request, and the server serves afterwards. Sampling at its limits (tiny temperature
or top_p), a sequence whose logits blow up, seeds outside int64, more sequences than the server takes at once,
bursts of model calls (next-token, analyze) beside a stream, and stop strings beyond their limits."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from contract import CMPL, GEN, NEXT, assert_error, sse_events
from fastapi.testclient import TestClient
from inprocess import assert_still_serving, engine_held, post_ok, serve, wait_until
from test_engine import greedy_params, held, run, running, tokens_generated

import server.engine as engine_module
from model.generate import GenerationError, SequenceState
from model.gpt import GPT
from model.loading import LoadedModel
from server.engine import QueueFull
from server.routes.deps import places, sse

GREEDY = {"temperature": 0, "ignore_eos": True}


def greedy_ids(client: TestClient, prompt: str, n: int) -> list[int]:
    body = post_ok(client, GEN, {"prompt": prompt, "max_new_tokens": n, **GREEDY})
    ids: list[int] = body["choices"][0]["token_ids"]
    return ids


# --- sampling at its limits, and a sequence whose logits blow up ------------------------------------


def test_a_tiny_temperature_or_top_p_shares_the_batch(loaded: LoadedModel) -> None:
    """Requests whose temperature or top_p vanish in float32 queue up with a greedy one and a stream, run
    in one batch, and all answer: greedy tokens (the limit) for the tiny ones, the same as alone for the
    greedy one."""
    tiny = [{"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 1e-46}, {"temperature": 1e-300, "top_p": 1e-46}]
    with serve(loaded) as c, ThreadPoolExecutor(6) as pool:
        want = {p: greedy_ids(c, p, 5) for p in ("Hi", "Hello world")}
        with engine_held(c) as engine:
            plain = pool.submit(c.post, GEN, json={"prompt": "Hello world", "max_new_tokens": 5, **GREEDY})
            small = [
                pool.submit(c.post, GEN, json={"prompt": "Hi", "max_new_tokens": 5, "ignore_eos": True, **t})
                for t in tiny
            ]
            streamed = {"prompt": "Hi", "max_new_tokens": 5, "temperature": 1e-300, "ignore_eos": True, "stream": True}
            stream = pool.submit(c.post, GEN, json=streamed)
            wait_until(lambda: len(engine._waiting) == 6)
        assert plain.result(30).json()["choices"][0]["token_ids"] == want["Hello world"]
        for r in (f.result(30) for f in small):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want["Hi"]
        events = sse_events(stream.result(30).text)
        assert all("error" not in e for e in events) and events[-1]["finish_reason"] == "length"
        assert [e["token_id"] for e in events[:-1]] == want["Hi"]
        assert_still_serving(c)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_edits_that_blow_up_the_logits_are_a_400(loaded: LoadedModel, temperature: float) -> None:
    """A request whose interventions overflow the activations gets a 400 saying so; a request running
    beside it is untouched."""
    blow_up = {"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 1e38}
    with serve(loaded) as c, ThreadPoolExecutor(2) as pool:
        want = greedy_ids(c, "Hello world", 20)
        with engine_held(c) as engine:  # both queue up, so that they run side by side
            plain = pool.submit(c.post, GEN, json={"prompt": "Hello world", "max_new_tokens": 20, **GREEDY})
            bad = {"prompt": "Hi", "max_new_tokens": 5, "temperature": temperature, "interventions": [blow_up]}
            blown = pool.submit(c.post, GEN, json=bad)
            wait_until(lambda: engine.metrics.registry.get_sample_value("gpt2_queue_depth") == 2)
        error = assert_error(blown.result(30), 400, "interventions")
        assert "logits became non-finite" in error["message"] and "interventions" in error["message"]
        assert plain.result(30).json()["choices"][0]["token_ids"] == want
        assert_still_serving(c)


def test_edits_that_blow_up_a_stream_end_it_with_a_client_error(loaded: LoadedModel) -> None:
    """Found mid-stream (the status line is sent), the error comes as an event naming the request's fault,
    not as an internal error."""
    blow_up = {"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 1e38}
    with serve(loaded) as c:
        r = c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 5, "stream": True, "interventions": [blow_up]})
        assert r.status_code == 200
        events = sse_events(r.text)
        error = events[-1]["error"]
        assert error["type"] == "invalid_request_error" and "logits became non-finite" in error["message"]
        assert error["param"] == "interventions"
        assert_still_serving(c)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_scored_from_non_finite_logits_is_a_400(loaded: LoadedModel, stream: bool) -> None:
    """Echoed prompt log-probabilities (lm-evaluation-harness' scoring) from logits that are not finite (here
    broken weights: an infinite position embedding at position 3) are the error a new token's are, naming the
    prompt token, not log-probabilities of null; a prompt that ends before it is scored as before."""
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        model.wpe.weight[3] = float("inf")
    broken = dataclasses.replace(loaded, model=model)
    score = {"max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    with serve(broken) as c:
        r = c.post(CMPL, json={**score, "prompt": [464, 2068, 7586, 21831, 18045, 625]})
        says = "the logits became non-finite (inf or NaN) at prompt token 5: the activations overflowed (the weights"
        if stream:
            assert r.status_code == 200
            error = sse_events(r.text)[-1]["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith(says), error
        else:
            assert assert_error(r, 400)["message"].startswith(says)
        logprobs = post_ok(c, CMPL, {**score, "prompt": [464, 2068, 7586], "stream": False})["choices"][0]["logprobs"]
        first, *rest = logprobs["token_logprobs"]
        assert first is None and len(rest) == 2 and all(isinstance(x, float) for x in rest)
        assert_still_serving(c)


def test_a_stream_writes_infinities_and_nan_as_null_as_a_whole_answer_does() -> None:
    """A log-probability of -inf (finite logits further apart than float32 can subtract) is null in a stream's
    event, as in the whole answer: JSON has no -Infinity, and parsers other than Python's refuse it."""

    async def events() -> Any:
        yield {"token_logprobs": [None, -math.inf, math.nan, math.inf, -1.5], "text": "caf\u00e9"}
        yield {"text": "a\u2028b\u2029c\x85d\ne"}  # what str.splitlines and httpx's iter_lines take for line ends

    async def read() -> bytes:
        return b"".join([piece async for piece in sse(events()).body_iterator])  # type: ignore[misc]

    body = asyncio.run(read()).decode()
    want = [
        {"token_logprobs": [None, None, None, None, -1.5], "text": "caf\u00e9"},
        {"text": "a\u2028b\u2029c\x85d\ne"},
    ]
    assert sse_events(body) == want
    lines = [line for line in body.splitlines() if line]  # as httpx's iter_lines splits them
    assert [json.loads(line.removeprefix("data: ")) for line in lines[:-1]] == want and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_of_one_prompt_of_several_names_it(loaded: LoadedModel, stream: bool) -> None:
    """Of several prompts, the one whose edit fails is named by its place: an edit's position past the second
    prompt's end only (its range, not the first's, in the message), logits that overflow in the first only
    (the second alone is served); streamed, the error event names it too."""
    past = {"hook": "blocks.0.hook_resid_pre", "op": "zero", "positions": [5]}
    with serve(loaded) as c:
        body = {"input_ids": [[1, 2, 3, 4, 5], [7]], "max_new_tokens": 3, **GREEDY, "interventions": [past]}
        error = assert_error(c.post(GEN, json=body | {"stream": stream}), 400, "interventions")
        assert error["message"].startswith("input_ids[1]: ") and "position 5 is out of range 0..3" in error["message"]
        # prompts as long as each other fail alike: the request's fault, named by no prompt
        body["input_ids"] = [[7, 8], [9, 10]]
        error = assert_error(c.post(GEN, json=body | {"stream": stream}), 400, "interventions")
        message = error["message"]
        assert message.startswith("interventions[0] (") and "position 5 is out of range 0..4" in message
        blow_up = {"hook": "blocks.0.hook_resid_pre", "op": "scale", "factor": 1e38, "positions": [4]}
        body = {"input_ids": [[1, 2, 3, 4, 5], [7, 8]], "max_new_tokens": 3, **GREEDY, "interventions": [blow_up]}
        assert post_ok(c, GEN, body | {"input_ids": [[7, 8]]})["choices"][0]["finish_reason"] == "length"
        r = c.post(GEN, json=body | {"stream": stream})
        if stream:
            assert r.status_code == 200
            error = sse_events(r.text)[-1]["error"]
            assert error["param"] == "interventions"
        else:
            error = assert_error(r, 400, "interventions")
        assert error["message"].startswith("input_ids[0]: the logits became non-finite"), error
        one = c.post(GEN, json=body | {"input_ids": [1, 2, 3, 4, 5]})  # one prompt: no place to name
        assert assert_error(one, 400, "interventions")["message"].startswith("the logits became non-finite")
        vocab = loaded.model.config.vocab_size  # the whole request's fault: no prompt named
        error = assert_error(c.post(GEN, json=body | {"stop_token_ids": [vocab]}), 400, "stop_token_ids")
        assert error["message"].startswith("stop token id"), error
        assert_still_serving(c)
    assert places("prompt", [[1], [2]], 2) == ["prompt[0]", "prompt[0]", "prompt[1]", "prompt[1]"]  # OpenAI's n
    assert places("prompt", [[1]], 3) is None


@pytest.mark.parametrize("legit", [False, True])
def test_a_sequence_whose_keys_overflowed_leaves_nothing_in_its_row(loaded: LoadedModel, legit: bool) -> None:
    """Keys a sequence's edits made inf leave with it (whether it failed, or hid them from its own output and
    succeeded): a later plain sequence in its row, decoding beside a longer hooked one (a pass that reads
    every row's keys up to the longest row's, masked), gets the tokens it gets alone. It failed with "the
    logits became non-finite" before."""
    inf_keys = [{"hook": "blocks.0.attn.hook_k", "op": "scale", "factor": 3e38, "heads": [0]}] * 2
    if legit:  # head 0's scores zeroed: its inf keys never reach this sequence's own output
        inf_keys.append({"hook": "blocks.0.attn.hook_attn_scores", "op": "zero", "heads": [0]})
    overflowing = {"input_ids": list(range(1000, 1060)), "max_new_tokens": 3, **GREEDY, "interventions": inf_keys}
    hooked = {"input_ids": list(range(2000, 2050)), "max_new_tokens": 5, **GREEDY}
    with serve(loaded, max_batch_size=2) as c, ThreadPoolExecutor(2) as pool:
        want = greedy_ids(c, "Hello world", 20)
        r = c.post(GEN, json=overflowing)
        if legit:
            assert r.status_code == 200, r.text
        else:
            assert_error(r, 400, "interventions")
        with engine_held(c) as engine:  # the plain one takes row 0 (the overflowing one's), the hooked one row 1
            depth = engine.metrics.registry.get_sample_value
            plain = pool.submit(c.post, GEN, json={"prompt": "Hello world", "max_new_tokens": 20, **GREEDY})
            wait_until(lambda: depth("gpt2_queue_depth") == 1)
            capture = pool.submit(c.post, GEN, json=hooked | {"activations": {"hooks": ["blocks.0.hook_resid_pre"]}})
            wait_until(lambda: depth("gpt2_queue_depth") == 2)
        assert plain.result(30).json()["choices"][0]["token_ids"] == want
        assert capture.result(30).status_code == 200
        assert_still_serving(c)


def test_a_failing_sequence_ends_alone_in_the_shared_batch(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence whose own work fails (here: its stop-string check raises) gets that error; the others
    in the same batch finish with the tokens they get alone, and the engine goes on serving."""
    prompt = loaded.tokenizer.encode("Hello world")
    release = SequenceState._release

    def fails_for_index_1(self: SequenceState) -> str:
        if self.index == 1 and len(self.tokens) == 3:
            raise RuntimeError("injected failure")
        return release(self)

    async def main() -> None:
        with running(loaded, max_batch_size=4) as engine:
            async with held(engine):
                ok_0, failing, ok_2 = engine.submit([prompt] * 3, [greedy_params(10, ignore_eos=True)] * 3)
                monkeypatch.setattr(SequenceState, "_release", fails_for_index_1)
            with pytest.raises(RuntimeError, match="injected failure"):
                await failing.result()
            got = await asyncio.gather(ok_0.result(), ok_2.result())
            monkeypatch.setattr(SequenceState, "_release", release)
            (alone,) = engine.submit([prompt], [greedy_params(10, ignore_eos=True)])
            assert [c.token_ids for c in got] == [(await alone.result()).token_ids] * 2

    run(main())


# --- seeds -----------------------------------------------------------------------------------------


def test_seeds_outside_int64_are_a_400(loaded: LoadedModel) -> None:
    with serve(loaded) as c:
        for seed in (2**64, 10**30, -(2**63) - 1, 2**63):
            error = assert_error(c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 2, "seed": seed}), 400, "seed")
            assert str(seed) in error["message"] and "int64" in error["message"]
            assert_error(c.post(CMPL, json={"prompt": "Hi", "max_tokens": 2, "seed": seed}), 400, "seed")
        assert_error(c.post(CMPL, json={"prompt": "Hi", "max_tokens": 2, "seed": 2**64 - 1, "n": 2}), 400, "seed")
        for seed in (2**63 - 1, -(2**63)):
            body = post_ok(c, GEN, {"prompt": "Hi", "max_new_tokens": 2, "seed": seed, "ignore_eos": True})
            assert len(body["choices"][0]["token_ids"]) == 2
        # n samples take seed, seed + 1, ...: wrapping within int64, so the last valid seed serves n = 2
        body = post_ok(c, CMPL, {"prompt": "Hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
        assert len(body["choices"]) == 2
        assert_still_serving(c)


# --- more sequences than the server takes at once -----------------------------------------------


def test_more_sequences_than_the_server_takes_at_once_are_a_400(loaded: LoadedModel) -> None:
    """429 would tell the client to retry, which could never succeed. An idle server takes the batch's places
    and the queue's at once: as many are served."""
    with serve(loaded, max_queue=8, max_batch_size=4) as c:
        error = assert_error(c.post(CMPL, json={"prompt": "Hello", "max_tokens": 2, "n": 13}), 400)
        assert "13 sequences" in error["message"], error
        assert "takes at once (12: its --max-batch-size 4 decoding and --max-queue 8 waiting)" in error["message"]
        assert_error(c.post(GEN, json={"input_ids": [[1, 1]] * 13, "max_new_tokens": 1}), 400)
        body = post_ok(c, CMPL, {"prompt": "Hello", "max_tokens": 2, "n": 12})
        assert len(body["choices"]) == 12
        assert len(post_ok(c, GEN, {"input_ids": [[1, 1]] * 12, "max_new_tokens": 1})["choices"]) == 12
        assert_still_serving(c)


def test_too_many_prompts_are_refused_before_any_is_read(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count comes first, before any prompt is encoded or checked: 650,000 one-word prompts took seconds of
    CPU and half a gigabyte to be refused, 800,000 one-id prompts seconds of the event loop (every stream
    stalled). So prompts that are each invalid get the count's 400, and the tokenizer is never called."""

    def no_encoding(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompts were encoded")

    with serve(loaded, max_queue=8, max_batch_size=4) as c:
        monkeypatch.setattr(loaded.tokenizer, "encode_batch", no_encoding)
        for url, body, param in [
            (GEN, {"prompt": ["Hi"] * 5000, "max_new_tokens": 1}, "prompt"),
            (GEN, {"input_ids": [[-1]] * 5000, "max_new_tokens": 1}, "input_ids"),  # each outside the vocabulary
            ("/v1/activations", {"input_ids": [[]] * 13}, "input_ids"),  # each empty
            (CMPL, {"prompt": ["Hi"] * 13, "max_tokens": 1}, "prompt"),
            (CMPL, {"prompt": [[50257]] * 13, "max_tokens": 1}, "prompt"),
        ]:
            error = assert_error(c.post(url, json=body), 400, param)
            assert "takes at once (12: its --max-batch-size 4" in error["message"], (url, error)
        monkeypatch.undo()
        assert_still_serving(c)


def test_a_text_too_long_for_the_context_is_refused_before_it_is_encoded(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text of more bytes than the context's tokens could spell (each token at most as many bytes as the
    longest in the vocabulary) is a 400 context_length_exceeded at once: a 4 MB text took 3 s of CPU and
    600 MB to be encoded and then refused. /tokenize, which has no context to fit, still encodes it."""
    n_ctx, most = loaded.model.config.n_positions, loaded.tokenizer.most_bytes_a_token
    assert most is not None and 128 <= most <= 256  # GPT-2's longest token: 128 bytes, 256 as its string spells them
    text = "a" * (n_ctx * most + 1)
    with serve(loaded) as c:
        monkeypatch.setattr(loaded.tokenizer, "encode_batch", lambda *a, **k: pytest.fail("the text was encoded"))
        for url, body, param in [
            (GEN, {"prompt": text, "max_new_tokens": 1}, "prompt"),
            (GEN, {"prompt": ["Hi", text], "max_new_tokens": 1}, "prompt"),
            (CMPL, {"prompt": text, "max_tokens": 1}, "prompt"),
            ("/v1/next-token", {"prompt": text}, "prompt"),
        ]:
            r = c.post(url, json=body)
            error = assert_error(r, 400, param)
            assert f"{n_ctx * most + 1} bytes of text" in error["message"], (url, error)
            assert f"longer than the context of {n_ctx} tokens" in error["message"], (url, error)
            if url == CMPL:  # OpenAI's code for it
                assert error["code"] == "context_length_exceeded", error
        monkeypatch.undo()
        r = c.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200 and len(r.json()["tokens"]) > n_ctx, r.text[:200]
        assert_still_serving(c)


def test_more_sequences_than_the_server_takes_build_none(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count is checked before any sequence (and its random generator) is made: a huge request costs
    nothing."""
    built: list[int] = []
    new_sequence = engine_module.new_sequence

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return new_sequence(*args, **kwargs)

    monkeypatch.setattr(engine_module, "new_sequence", counting)

    async def main() -> None:
        with running(loaded, max_batch_size=1, max_queue=2) as engine:
            with pytest.raises(GenerationError, match="--max-queue 2 waiting"):
                engine.submit([[1, 1]] * 1000, [greedy_params(1)] * 1000)
            assert built == []

    run(main())


def test_an_invalid_request_is_a_400_even_when_the_queue_is_full(loaded: LoadedModel) -> None:
    """A retry of an invalid request could only fail again: it is refused as invalid, not as 'busy'."""
    with serve(loaded, max_queue=1, max_batch_size=1) as c, ThreadPoolExecutor(2) as pool:
        with engine_held(c) as engine:
            waiting = [pool.submit(c.post, GEN, json={"prompt": "Hi", "max_new_tokens": 1}) for _ in range(2)]
            wait_until(lambda: engine.metrics.registry.get_sample_value("gpt2_queue_depth") == 2)
            too_long = {"input_ids": [464] * 100, "max_new_tokens": 60}
            assert_error(c.post(GEN, json=too_long), 400, "max_new_tokens")
            hooks = {"hooks": ["blocks.9.hook_resid_post"]}
            assert_error(c.post(GEN, json={"prompt": "Hi", "activations": hooks}), 400, "activations.hooks")
            assert_error(c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 1}), 429)
        assert [w.result(30).status_code for w in waiting] == [200, 200]
        assert_still_serving(c)


def test_a_request_cancelled_in_the_queue_gives_its_place_back(loaded: LoadedModel) -> None:
    """A client that leaves while its request waits for a row frees its place in the queue at once, not
    when a row frees up: the queue takes a new request meanwhile."""

    async def main() -> None:
        with running(loaded, max_batch_size=1, max_queue=2) as engine:
            async with held(engine):
                for stream in engine.submit([[464], [464]], [greedy_params(2)] * 2):
                    stream.cancel()
                assert engine.metrics.registry.get_sample_value("gpt2_queue_depth") == 0
                (kept,) = engine.submit([[464]], [greedy_params(2)])
            assert len((await kept.result()).token_ids) == 2
            assert tokens_generated(engine) == 2

    run(main())


# --- model calls: bounded, and one between two decode steps -----------------------------------------


def test_model_calls_are_bounded(loaded: LoadedModel) -> None:
    async def main() -> None:
        with running(loaded, max_queue=3) as engine:
            async with held(engine):
                waiting = [asyncio.ensure_future(engine.call(lambda m: 42)) for _ in range(3)]
                await asyncio.sleep(0)
                with pytest.raises(QueueFull):
                    await engine.call(lambda m: 0)
            assert await asyncio.gather(*waiting) == [42, 42, 42]
            assert await engine.call(lambda m: 7) == 7

    run(main())


def test_a_cancelled_model_call_leaves_the_queue_unrun(loaded: LoadedModel) -> None:
    """A call whose caller is cancelled (its client left) gives its place back and never runs."""
    ran: list[str] = []

    async def main() -> None:
        with running(loaded, max_queue=1) as engine:
            async with held(engine):
                gone = asyncio.ensure_future(engine.call(lambda m: ran.append("gone")))
                await asyncio.sleep(0)
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                kept = asyncio.ensure_future(engine.call(lambda m: ran.append("kept")))  # its place is free
                await asyncio.sleep(0)
            await kept
            assert ran == ["kept"]

    run(main())


def test_a_request_cancelled_while_a_call_runs_is_not_run(loaded: LoadedModel) -> None:
    """The engine takes a call and the requests it can admit from the queue together, then runs the call: a
    request cancelled meanwhile (it is in neither the queue nor the batch then) was admitted after the call
    and prefilled and decoded a step (for a prompt to dump, its whole pass, its reservation given back)."""
    started, release = threading.Event(), threading.Event()

    def job(_: GPT) -> None:
        started.set()
        release.wait(30)

    async def main() -> None:
        with running(loaded) as engine:
            async with held(engine):
                call = asyncio.ensure_future(engine.call(job))  # taken with the request, in one turn
                await asyncio.sleep(0)
                (stream,) = engine.submit([[464, 3797, 3332]], [greedy_params(50)])
                before = tokens_generated(engine)
            await asyncio.to_thread(started.wait, 30)
            assert stream._request not in engine._waiting  # taken from the queue, not yet in the batch
            stream.cancel()
            release.set()
            await call
            assert await engine.call(lambda m: 7) == 7  # a step later
            seq = stream._request.seq
            assert (seq.prefilled, seq.tokens, tokens_generated(engine) - before) == (0, [], 0)
            assert engine._active() == 0 and not engine._requests

    run(main())


def test_a_running_model_call_whose_caller_is_gone_stops_at_its_next_block(loaded: LoadedModel) -> None:
    """A long job (attribution's verification passes, a steering vector's prompts) whose client left stops as
    its next forward pass enters a block, instead of holding the engine to the end; the engine serves on."""
    started, proceed = threading.Event(), threading.Event()
    passes: list[int] = []
    ids = torch.tensor([[464, 3797, 3332]])

    def job(model: GPT) -> None:
        started.set()
        proceed.wait(30)
        for i in range(100):
            model(ids)
            passes.append(i)

    async def main() -> None:
        with running(loaded) as engine:
            call = asyncio.ensure_future(engine.call(job))
            await asyncio.to_thread(started.wait, 30)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            proceed.set()
            assert await engine.call(lambda m: 7) == 7  # after the job: it ended
            assert passes == []
        assert not any(block._forward_pre_hooks for block in loaded.model.h)  # each job's checks removed

    run(main())


def test_next_token_and_analyze_beyond_the_queue_are_a_429(loaded: LoadedModel) -> None:
    with serve(loaded, max_queue=2) as c, ThreadPoolExecutor(2) as pool:
        with engine_held(c) as engine:
            waiting = [pool.submit(c.post, path, json={"prompt": "Hello"}) for path in (NEXT, "/v1/analyze")]
            wait_until(lambda: len(engine._jobs) == 2)
            for path in (NEXT, "/v1/analyze"):
                r = c.post(path, json={"prompt": "Hello"})
                assert_error(r, 429, None)
                assert int(r.headers["retry-after"]) >= 1
        assert [f.result(30).status_code for f in waiting] == [200, 200]
        post_ok(c, NEXT, {"prompt": "Hello"})
        assert_still_serving(c)


def test_model_calls_run_one_between_two_decode_steps(loaded: LoadedModel) -> None:
    """A burst of calls queued while a sequence decodes is spread over its steps: each call sees more
    tokens generated than the one before it, so the stream never waits for the whole burst."""

    async def main() -> list[float]:
        with running(loaded) as engine:
            (long,) = engine.submit([[464]], [greedy_params(120, ignore_eos=True)])
            async for _ in long:
                break
            async with held(engine):
                calls = [asyncio.ensure_future(engine.call(lambda m: tokens_generated(engine))) for _ in range(5)]
                await asyncio.sleep(0)
            seen = list(await asyncio.gather(*calls))
            long.cancel()
            return seen

    seen = run(main())
    assert seen == sorted(set(seen)), seen


# --- stop strings ----------------------------------------------------------------------------------


def test_too_many_or_too_long_stop_strings_are_a_400(loaded: LoadedModel) -> None:
    with serve(loaded) as c:
        for stop, message in (([f"s{i}" for i in range(17)], "at most 16 strings"), (["x" * 257], "256 characters")):
            for path, body in ((GEN, {"max_new_tokens": 2}), (CMPL, {"max_tokens": 2})):
                error = assert_error(c.post(path, json={"prompt": "Hi", "stop": stop, **body}), 400, "stop")
                assert message in error["message"]
        body = post_ok(c, GEN, {"prompt": "Hi", "max_new_tokens": 2, "stop": [f"s{i}" for i in range(16)]})
        assert body["choices"][0]["finish_reason"] in ("length", "stop", "eos")
        assert_still_serving(c)


def test_stop_token_ids_outside_the_vocabulary_are_a_400(loaded: LoadedModel) -> None:
    vocab = loaded.model.config.vocab_size
    with serve(loaded) as c:
        for bad in (-5, vocab, 10**30):
            body = {"prompt": "Hi", "max_new_tokens": 2, "stop_token_ids": [1, bad]}
            error = assert_error(c.post(GEN, json=body), 400, "stop_token_ids")
            assert f"stop token id {bad} is outside the vocabulary" in error["message"]
        body = post_ok(c, GEN, {"prompt": "Hi", "max_new_tokens": 2, "stop_token_ids": [0, vocab - 1]})
        assert len(body["choices"][0]["token_ids"]) <= 2
        assert_still_serving(c)
