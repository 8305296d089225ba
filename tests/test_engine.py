"""The engine on its own (asyncio, no HTTP): continuous batching admits a request at the next step, a
cancelled request frees its row, the queue is bounded, jobs run on the engine's thread, a failing batch
ends only its own sequences, and stopping fails what is pending."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import pytest
import torch
from contract import greedy

from model.generate import Completion, SamplingParams, TokenEvent, generate, pass_blocks
from model.hooks import run_with_cache
from model.interventions import Edit, EditSpec
from model.loading import LoadedModel
from server.engine import Engine, EngineStopped, QueueFull, RequestStream, default_prefill_chunk

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
    """Run a test's coroutine, failing it (instead of hanging) after `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextmanager
def running(loaded: LoadedModel, **kwargs: Any) -> Iterator[Engine]:
    engine = Engine(loaded, **kwargs)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def greedy_params(max_new_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def tokens_generated(engine: Engine) -> float:
    return engine.metrics.registry.get_sample_value("gpt2_tokens_generated_total") or 0.0


async def wait_for(condition: Any, timeout: float = 20) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


@asynccontextmanager
async def held(engine: Engine) -> AsyncIterator[asyncio.Task[str]]:
    """Hold the engine's thread in a job, so that submitted requests wait in the queue until the block ends."""
    started, release = threading.Event(), threading.Event()

    def hold(_: Any) -> str:
        started.set()
        release.wait(30)
        return "held"

    task = asyncio.ensure_future(engine.call(hold))
    try:
        await wait_for(started.is_set)
        yield task
    finally:
        release.set()


async def first_event(stream: RequestStream) -> tuple[TokenEvent, AsyncIterator[TokenEvent]]:
    events = stream.__aiter__()
    return await events.__anext__(), events


LONG = 120  # tokens: the context is 128


def test_running_sequences_gauge(loaded: LoadedModel) -> None:
    """`gpt2_running_sequences` counts the sequences in the batch: two while they generate, one after the
    other's client left, none once the last has finished."""

    def running_now(engine: Engine) -> float | None:
        return engine.metrics.registry.get_sample_value("gpt2_running_sequences")

    async def main() -> None:
        with running(loaded, max_batch_size=4) as engine:
            long, short = engine.submit([[464], [464, 318]], [greedy_params(LONG, ignore_eos=True)] * 2)
            await first_event(long)
            await first_event(short)
            assert running_now(engine) == 2
            short.cancel()
            await wait_for(lambda: running_now(engine) == 1)
            await long.result()
            await wait_for(lambda: running_now(engine) == 0)

    run(main())


def test_sequences_taken_from_the_queue_count_as_running_while_a_job_runs(loaded: LoadedModel) -> None:
    """The engine takes waiting sequences into the batch's slots, then runs a job before their first step: they
    count in `gpt2_running_sequences` from then on (they were in neither gauge while the job ran)."""

    def gauge(engine: Engine, name: str) -> float | None:
        return engine.metrics.registry.get_sample_value(name)

    async def main() -> None:
        with running(loaded, max_batch_size=4) as engine:
            started, release = threading.Event(), threading.Event()

            def hold(_: Any) -> str:
                started.set()
                release.wait(30)
                return "held"

            async with held(engine):
                streams = engine.submit([[464], [464, 318]], [greedy_params(2)] * 2)
                second = asyncio.ensure_future(engine.call(hold))  # run next, after the two are taken
                await wait_for(lambda: len(engine._jobs) == 1)
            await wait_for(started.is_set)
            assert (gauge(engine, "gpt2_queue_depth"), gauge(engine, "gpt2_running_sequences")) == (0, 2)
            release.set()
            assert await second == "held"
            for stream in streams:
                assert len((await stream.result()).token_ids) == 2
            await wait_for(lambda: gauge(engine, "gpt2_running_sequences") == 0)

    run(main())


def test_request_joins_at_the_next_step(loaded: LoadedModel) -> None:
    """A short request submitted while a long one decodes is served beside it and finishes first."""
    long_prompt, short_prompt = [464], loaded.tokenizer.encode("The quick brown fox")
    finished: list[str] = []

    async def main() -> tuple[Completion, Completion, int]:
        with running(loaded, max_batch_size=4) as engine:
            (long,) = engine.submit([long_prompt], [greedy_params(LONG, ignore_eos=True)])
            first, rest = await first_event(long)
            long_events = [first]

            async def drain() -> None:
                async for event in rest:
                    long_events.append(event)
                finished.append("long")

            draining = asyncio.create_task(drain())
            (short,) = engine.submit([short_prompt], [greedy_params(3, ignore_eos=True)])
            short_result = await short.result()
            finished.append("short")
            long_so_far = len(long_events)
            await draining
            assert long.completion is not None
            return long.completion, short_result, long_so_far

    long_result, short_result, long_so_far = run(main())
    assert finished == ["short", "long"]
    assert long_so_far < LONG
    assert long_result.token_ids == greedy(loaded, long_prompt, LONG, ignore_eos=True).token_ids
    assert short_result.token_ids == greedy(loaded, short_prompt, 3, ignore_eos=True).token_ids


def test_cancel_frees_the_row(loaded: LoadedModel) -> None:
    """With one row, a request waiting behind a long one runs as soon as the long one is cancelled."""
    prompt = loaded.tokenizer.encode("Hello world")

    async def main() -> None:
        with running(loaded, max_batch_size=1, max_queue=4) as engine:
            (long,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(long)
            assert engine._active() == 1
            (waiting,) = engine.submit([prompt], [greedy_params(3, ignore_eos=True)])
            long.cancel()
            result = await waiting.result()
            assert result.token_ids == greedy(loaded, prompt, 3, ignore_eos=True).token_ids
            # the one row served the long request, then the waiting one: the long one was cut short
            assert tokens_generated(engine) < LONG + 3
            await wait_for(lambda: engine._active() == 0)
            long.cancel()  # again, after the end: harmless
            (after,) = engine.submit([prompt], [greedy_params(2)])
            assert len((await after.result()).token_ids) == 2

    run(main())


def test_cancel_while_waiting(loaded: LoadedModel) -> None:
    """A request cancelled before it got a row is never run."""

    async def main() -> None:
        with running(loaded, max_batch_size=1) as engine:
            async with held(engine) as job:
                (gone,) = engine.submit([[464]], [greedy_params(50, ignore_eos=True)])
                (kept,) = engine.submit([[464]], [greedy_params(2, ignore_eos=True)])
                gone.cancel()
            assert await job == "held"
            assert len((await kept.result()).token_ids) == 2
            await wait_for(lambda: engine._active() == 0)
            assert tokens_generated(engine) == 2

    run(main())


def test_queue_bound(loaded: LoadedModel) -> None:
    """`max_queue` sequences wait beyond the batch's free places: with the batch empty (a job holds the engine)
    `max_batch_size` + `max_queue` are taken at once, as Ray Serve's `max_ongoing_requests` sends them."""

    async def main() -> None:
        with running(loaded, max_batch_size=1, max_queue=2) as engine:
            async with held(engine) as job:
                a, b = engine.submit([[464], [464]], [greedy_params(2)] * 2)
                (c,) = engine.submit([[464]], [greedy_params(2)])
                with pytest.raises(QueueFull) as refused:  # all or none: 3 + 2 > 2 + 1
                    engine.submit([[464], [464]], [greedy_params(2)] * 2)
                assert str(refused.value) == (  # what this request needs, beside what the server holds
                    "the request's 2 sequences do not fit now: room for 0 more (1 free place in the batch and 2 in the "
                    "queue, with 3 sequences waiting)"
                )
                with pytest.raises(QueueFull):
                    engine.submit([[464]], [greedy_params(2)])
                assert engine.metrics.registry.get_sample_value("gpt2_queue_depth") == 3
            assert await job == "held"
            assert [len(r.token_ids) for r in await asyncio.gather(a.result(), b.result(), c.result())] == [2, 2, 2]
            (d,) = engine.submit([[464]], [greedy_params(1)])  # room again
            await d.result()

    run(main())


def test_a_large_request_refused_for_room_is_not_kept_out_by_smaller_ones(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of many sequences refused for the lack of room (a 429) holds that room for its retry: smaller
    requests are taken only beside it (else refused, saying so) until it is back, and the hold lapses after
    `CLAIM_S` for a client that gave up. Without it, small requests arriving all the time would keep it out."""

    async def main() -> None:
        with running(loaded, max_batch_size=1, max_queue=3) as engine:
            async with held(engine) as job:
                (a,) = engine.submit([[464]], [greedy_params(2)])  # waits: room for 3 more
                with pytest.raises(QueueFull):
                    engine.submit([[464]] * 4, [greedy_params(2)] * 4)  # 4 > 3: refused, its room held
                with pytest.raises(QueueFull) as refused:
                    engine.submit([[464]], [greedy_params(2)])  # would fit, but not beside the 4 held
                assert str(refused.value) == (
                    "the request's 1 sequence does not fit now: room for 0 more (1 free place in the batch and 3 in "
                    "the queue, with 1 sequence waiting; 4 of those places held for a larger request refused before, "
                    "which comes first)"
                )
            assert await job == "held"
            await a.result()
            big = engine.submit([[464]] * 4, [greedy_params(2)] * 4)  # the retry, once there is room: taken
            assert [len(r.token_ids) for r in await asyncio.gather(*(s.result() for s in big))] == [2] * 4
            async with held(engine) as job:  # and the hold went with it: 4 single ones fit where it stood
                smalls = [engine.submit([[464]], [greedy_params(1)])[0] for _ in range(4)]
            await asyncio.gather(job, *(s.result() for s in smalls))
            monkeypatch.setattr("server.engine.CLAIM_S", 0.0)  # a client that never comes back
            async with held(engine) as job:
                (c,) = engine.submit([[464]], [greedy_params(1)])
                with pytest.raises(QueueFull):
                    engine.submit([[464]] * 4, [greedy_params(1)] * 4)
                (d,) = engine.submit([[464]], [greedy_params(1)])  # its hold lapsed at once
            await asyncio.gather(job, c.result(), d.result())

    run(main())


def test_call_runs_on_the_engine_thread(loaded: LoadedModel) -> None:
    async def main() -> None:
        with running(loaded) as engine:
            name, model = await engine.call(lambda m: (threading.current_thread().name, m))
            assert name == "gpt2-engine"
            assert name != threading.current_thread().name
            assert model is loaded.model
            with pytest.raises(ZeroDivisionError):
                await engine.call(lambda m: 1 / 0)
            # between decode steps: a job submitted during a long generation returns before it ends
            (long,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(long)
            assert await engine.call(lambda m: tokens_generated(engine)) < LONG
            long.cancel()
            assert await engine.call(lambda m: 42) == 42

    run(main())


def test_failing_batch_ends_only_its_sequences(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass that raises with a capturing request in the shared batch fails that request with the
    error; the plain sequence decoding beside it is untouched (the step is taken again without the
    capturing one), and the engine goes on serving."""
    prompt = loaded.tokenizer.encode("Hello world")
    forward = loaded.model.forward

    def fails_with_hooks(*args: Any, **kwargs: Any) -> torch.Tensor:
        hooks = kwargs.get("hooks", args[2] if len(args) > 2 else None)
        if hooks is not None:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    async def main() -> None:
        with running(loaded, max_batch_size=4) as engine:
            (plain,) = engine.submit([prompt], [greedy_params(40, ignore_eos=True)])
            await first_event(plain)
            monkeypatch.setattr(loaded.model, "forward", fails_with_hooks)
            (capturing,) = engine.submit([prompt], [greedy_params(3)], hooks=["blocks.0.hook_resid_post"])
            with pytest.raises(RuntimeError, match="injected failure"):
                await capturing.result()
            monkeypatch.setattr(loaded.model, "forward", forward)
            result = await plain.result()
            assert result.token_ids == greedy(loaded, prompt, 40, ignore_eos=True).token_ids
            (again,) = engine.submit([prompt], [greedy_params(3)], hooks=["blocks.0.hook_resid_post"])
            assert (await again.result()).activations is not None

    run(main())


def test_chunked_prefill_equals_whole(loaded: LoadedModel) -> None:
    """Long prompts prefilled a few tokens per step, while another sequence decodes, give the same tokens
    and prompt log-probabilities as in one pass."""
    prompts = [[(7 * i + 3) % 50000 for i in range(90)], loaded.tokenizer.encode("The quick brown fox jumps")]

    async def main() -> list[Completion]:
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            (decoding,) = engine.submit([[464]], [greedy_params(30, ignore_eos=True)])
            await first_event(decoding)
            streams = engine.submit(prompts, [greedy_params(8, ignore_eos=True, prompt_logprobs=1)] * 2)
            return list(await asyncio.gather(*(s.result() for s in streams), decoding.result()))

    *results, _ = run(main())
    for prompt, result in zip(prompts, results, strict=True):
        ref = greedy(loaded, prompt, 8, ignore_eos=True, prompt_logprobs=1)
        assert result.token_ids == ref.token_ids
        assert result.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert result.prompt_logprobs[0] is None
        got = [lp.logprob for lp in result.prompt_logprobs[1:] if lp is not None]
        want = [lp.logprob for lp in ref.prompt_logprobs[1:] if lp is not None]
        assert got == pytest.approx(want, abs=1e-4)


HOOKED_EDITS = {
    "positions and a square": (
        Edit("blocks.0.hook_attn_out", "scale", factor=0.5, positions=(3, 40, 85)),
        Edit("blocks.1.attn.hook_pattern", "zero", heads=(1,), positions=(20, 70)),
    ),
    "a whole sequence's values": (
        Edit("blocks.1.hook_resid_pre", "set", value=torch.linspace(-1, 1, 98 * 64).reshape(98, 64)),
    ),
    "mean": (Edit("blocks.0.hook_mlp_out", "mean"),),
}


@pytest.mark.parametrize("edits", list(HOOKED_EDITS), ids=list(HOOKED_EDITS))
def test_a_hooked_prompt_is_prefilled_in_chunks_unless_its_edits_need_it_whole(loaded: LoadedModel, edits: str) -> None:
    """A sequence that captures activations and applies edits, its 90-token prompt beside a decoding stream,
    prefills 16 tokens a step like any other (a prompt with hooks in one pass once stalled every stream for
    all of it: a second or two at 1,024 tokens of gpt2-small on a CPU); a `mean` edit, which takes its mean
    over the prompt, still has the prompt in one pass. Either way the tokens and the activations (a stream, an
    attention pattern widened over its chunks, the logits) are those of one pass over the whole prompt."""
    prompt = [(11 * i + 5) % 50000 for i in range(90)]
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "logits"]
    spec = EditSpec(HOOKED_EDITS[edits])
    chunks: list[tuple[int, int]] = []  # the hooked prompt's, as the steps take them

    async def main() -> Completion:
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            (decoding,) = engine.submit([[464]], [greedy_params(60, ignore_eos=True)])
            await first_event(decoding)
            take = engine._batch._chunks

            def logged() -> list[tuple[int, int, int]]:
                out = take()
                chunks.extend((start, end) for b, start, end in out if engine._batch.seqs[b].hooks is not None)
                return out

            engine._batch._chunks = logged  # type: ignore[method-assign]
            (hooked,) = engine.submit([prompt], [greedy_params(8, ignore_eos=True)], hooks=names, edits=spec)
            result = await hooked.result()
            await decoding.result()
            return result

    got = run(main())
    if edits == "mean":
        assert chunks == [(0, 90)]
    else:
        assert chunks == [(i, min(i + 16, 90)) for i in range(0, 90, 16)]
    (want,) = generate(loaded.model, [prompt], greedy_params(8, ignore_eos=True), hooks=names, edits=spec)
    assert got.token_ids == want.token_ids
    assert got.activations is not None and want.activations is not None
    for name in names:
        torch.testing.assert_close(got.activations[name], want.activations[name], rtol=1e-4, atol=1e-4)


WHOLE_AFTER = {  # (first, second, a stream decoding) -> steps from the first whole prompt's pass to the second's
    ("generation", "generation", True): 4,  # through every block, 4 chunks: 3 steps more
    ("dump", "dump", True): 2,  # to block 0 of 2, 2 chunks: 1 more
    ("dump", "generation", True): 2,  # 1 more, owed to the same batch
    ("generation", "generation", False): 1,
    ("dump", "dump", False): 1,
    ("dump", "generation", False): 0,  # the dump's pass, then the batch's step
}


@pytest.mark.parametrize(("first", "second", "streaming"), list(WHOLE_AFTER))
def test_whole_prompts_sent_back_to_back_wait_for_the_steps_they_took(
    loaded: LoadedModel, first: str, second: str, streaming: bool
) -> None:
    """Two 64-token prompts whose `mean` edit needs each whole, at chunks of 16, beside a decoding stream: the
    second's pass waits for the steps the first took beyond its own step's (`DecodeBatch.owed`, whether the
    first was a generation's, through every block, or a dump's pass to its last hook), so that such prompts sent
    back to back slow the streams as chunked prompts do (two clients sending 1,000-token ones held a server's
    streams at 0.9 tokens/s, from 40), those rows decoding meanwhile with the waiting row beside them. With no
    stream decoding, nothing waits."""
    prompts = [[(7 * t + k) % 50000 for t in range(64)] for k in (1, 2)]
    spec = EditSpec((Edit("blocks.0.hook_mlp_out", "mean"),))
    names = ["blocks.0.hook_resid_post"]
    params = {"dump": SamplingParams(max_new_tokens=0), "generation": greedy_params(2, ignore_eos=True)}
    steps = 0
    passes: list[int] = []  # the step each whole prompt's pass ran in

    async def main() -> list[Completion]:
        nonlocal steps
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            stream = None
            if streaming:
                (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
                await first_event(stream)
            real_step = engine._step_batch

            def step() -> None:
                nonlocal steps
                steps += 1
                real_step()

            def entered(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                if args[0].numel() >= 64:  # a whole prompt (with the stream's decode token, if packed)
                    passes.append(steps)

            engine._step_batch = step  # type: ignore[method-assign]
            hook = engine.model.wte.register_forward_pre_hook(entered)
            try:
                (a,) = engine.submit([prompts[0]], [params[first]], names, spec)
                (b,) = engine.submit([prompts[1]], [params[second]], names, spec)
                results = [await a.result(), await b.result()]
            finally:
                hook.remove()
            if stream is not None:
                stream.cancel()
            return results

    results = run(main())
    assert len(passes) == 2 and passes[1] - passes[0] == WHOLE_AFTER[first, second, streaming], passes
    for prompt, result in zip(prompts, results, strict=True):
        alone = run_with_cache(loaded.model, prompt, names, spec.hooks(loaded.model.config, 64))
        assert result.activations is not None
        got = result.activations[names[0]][:, :64]  # the prompt's positions (a generation's go on)
        torch.testing.assert_close(got, alone[names[0]], rtol=1e-4, atol=1e-4)


def test_a_pass_costs_its_blocks_and_the_heads_product_where_its_output_is_wanted(loaded: LoadedModel) -> None:
    """`pass_blocks`: the blocks a pass runs, and the LM head's product (vocab / (12·C) blocks) only for a hook
    of its output; the final LayerNorm's hooks, before it, cost no more than the last block."""
    config = loaded.model.config
    head = config.vocab_size / (12 * config.n_embd)
    assert pass_blocks(config, ["hook_embed"]) == 0
    assert pass_blocks(config, ["blocks.0.hook_resid_post", "hook_embed"]) == 1
    for name in ("ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_in"):
        assert pass_blocks(config, [name]) == config.n_layer, name
    for name in ("unembed.hook_out", "logits"):
        assert pass_blocks(config, ["blocks.0.hook_resid_post", name]) == config.n_layer + head, name


@pytest.mark.parametrize(
    ("names", "pieces"),
    [
        (["blocks.1.hook_resid_post"], ["block 0", "block 1"]),
        (["logits"], ["block 0", "block 1", "head"]),
        (["ln_final.hook_normalized"], ["block 0", "block 1", "head"]),  # the final LayerNorm only: charged 0
    ],
    ids=["to-the-last-block", "through-the-head", "to-the-final-layernorm"],
)
def test_a_whole_prompts_pass_runs_a_block_a_step_beside_the_streams(
    loaded: LoadedModel, names: list[str], pieces: list[str]
) -> None:
    """A 64-token dump whose `mean` edit needs its prompt whole, its pass costing more than a chunk of 16, runs
    a block a step (`PromptsPass`), then the LM head where a hook after it is dumped, the stream decoding a
    token between every two (its one pass held every stream for its whole length: 1.2 s at 1,000 tokens of
    gpt2-small on a 2-core CPU); its values are those of its prompt alone, to the bit. Its work is charged to
    the batch as it runs, in all what the one pass was charged (`pass_blocks`)."""
    prompt = [(7 * t + 1) % 50000 for t in range(64)]
    spec = EditSpec((Edit("blocks.0.hook_mlp_out", "mean"),))
    log: list[str] = []
    charged: list[int] = []

    async def main() -> Completion:
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(stream)
            real_step = engine._batch.step

            def step() -> Any:
                log.append("step")
                return real_step()

            def entered(piece: str) -> Any:
                def pre_hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                    if args[0].shape[1] == 64:  # the dump's pass
                        log.append(piece)

                return pre_hook

            engine._batch.step = step  # type: ignore[method-assign]
            real_charge = engine._batch.charge

            def charge(tokens: int) -> None:
                charged.append(tokens)
                real_charge(tokens)

            engine._batch.charge = charge  # type: ignore[method-assign]
            model = engine.model
            checks = [b.register_forward_pre_hook(entered(f"block {i}")) for i, b in enumerate(model.h)]
            checks.append(model.ln_f.register_forward_pre_hook(entered("head")))  # where the head's step begins
            try:
                (dump,) = engine.submit([prompt], [SamplingParams(max_new_tokens=0)], names, spec)
                result = await dump.result()
            finally:
                for check in checks:
                    check.remove()
            stream.cancel()
            return result

    result = run(main())
    ran = [e for e in log if e != "step"]
    assert ran == pieces, log
    first = log.index(pieces[0])
    assert log[first : first + 2 * len(pieces)] == [e for p in pieces for e in (p, "step")], log
    config = loaded.model.config
    assert len(charged) == len(pieces) and sum(charged) == round(64 * pass_blocks(config, names) / config.n_layer)
    alone = run_with_cache(loaded.model, prompt, names, spec.hooks(loaded.model.config, 64))
    assert result.activations is not None
    assert torch.equal(result.activations[names[0]], alone[names[0]])


def test_a_client_that_leaves_ends_its_whole_prompts_pass_at_the_next_block(loaded: LoadedModel) -> None:
    """A whole prompt's pass under way, a block a step, whose request is cancelled runs no further block: the
    engine goes on serving, and the next such pass runs."""
    prompt = [(7 * t + 1) % 50000 for t in range(64)]
    spec = EditSpec((Edit("blocks.0.hook_mlp_out", "mean"),))
    names = ["logits"]
    blocks: list[int] = []

    async def main() -> Completion:
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(stream)
            (dump,) = engine.submit([prompt], [SamplingParams(max_new_tokens=0)], names, spec)

            def pre_hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                if args[0].shape[1] == 64:
                    blocks.append(len(blocks))
                    if len(blocks) == 1:
                        dump.cancel()  # as the route does when its client leaves

            check = engine.model.h[0].register_forward_pre_hook(pre_hook)
            try:
                await asyncio.sleep(0.5)  # steps go on meanwhile
                assert engine._passing is None and not engine._prompt_only
                check.remove()
                (again,) = engine.submit([prompt], [SamplingParams(max_new_tokens=0)], names, spec)
                result = await again.result()
            finally:
                check.remove()
            stream.cancel()
            return result

    result = run(main())
    assert blocks == [0]  # block 0 ran once, for the pass that was cancelled before its next block
    assert result.activations is not None and result.finish_reason == "length"


def test_a_cheap_dump_goes_before_a_whole_prompt_that_waits(loaded: LoadedModel) -> None:
    """Behind a 96-token `mean` dump, whose pass makes the next such pass wait for the stream's steps, a
    4-token dump without edits, whose pass costs less than a chunk, is not held: it takes the next step."""
    spec = EditSpec((Edit("blocks.0.hook_mlp_out", "mean"),))
    names = ["blocks.0.hook_resid_post"]
    widths: list[int] = []  # tokens of each dump's pass, in the order they ran

    async def main() -> None:
        with running(loaded, max_batch_size=4, prefill_chunk=16) as engine:
            (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(stream)

            def entered(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                if args[0].numel() > 2:  # not a decode step
                    widths.append(args[0].numel())

            hook = engine.model.wte.register_forward_pre_hook(entered)
            try:
                dumps = [
                    *engine.submit([list(range(1, 97))], [SamplingParams(max_new_tokens=0)], names, spec),
                    *engine.submit([list(range(1, 97))], [SamplingParams(max_new_tokens=0)], names, spec),
                    *engine.submit([[5, 6, 7, 8]], [SamplingParams(max_new_tokens=0)], names),
                ]
                for d in dumps:
                    await d.result()
            finally:
                hook.remove()
            stream.cancel()

    run(main())
    assert widths == [96, 4, 96], widths


@pytest.mark.parametrize("chunk", [None, 16])
def test_the_batch_prefills_in_the_engines_chunks(loaded: LoadedModel, chunk: int | None) -> None:
    """The engine's batch takes the engine's prefill chunk, the device's default where none is given (a
    server once passed None on, and prefilled whole prompts in one pass while every decoding row waited)."""
    with running(loaded, prefill_chunk=chunk) as engine:
        want = default_prefill_chunk(loaded.device) if chunk is None else chunk
        assert engine.prefill_chunk == want
        assert engine._batch.prefill_chunk == want
        steps: list[int] = []  # prompt tokens each step prefills
        step = engine._batch.step

        def counted() -> list[Any]:
            steps.append(sum(end - start for _, start, end in engine._batch._chunks()))
            return step()

        engine._batch.step = counted  # type: ignore[method-assign]
        prompt = [(5 * i + 1) % 50000 for i in range(want + 5)]

        async def main() -> Completion:
            (stream,) = engine.submit([prompt], [greedy_params(1)])
            return await stream.result()

        assert len(run(main()).token_ids) == 1
    assert [n for n in steps if n] == [want, 5]


@pytest.mark.parametrize(
    ("length", "n", "edited", "per_pass"),
    [(16, 3, False, [1, 1, 1]), (5, 7, False, [3, 3, 1]), (5, 3, True, [1, 1, 1])],
    ids=["prompts of a chunk, one a pass", "short prompts share a pass", "edited prompts, one a pass"],
)
def test_prompts_to_dump_share_passes_of_a_prompt_chunk_with_decode_steps_between(
    loaded: LoadedModel, length: int, n: int, edited: bool, per_pass: list[int]
) -> None:
    """Prompts that only dump activations, each no longer than a prompt chunk (16 here), run in padded passes of
    at most a chunk's tokens (B x the longest), one pass between two of the stream's decode steps: a batch of
    prompts stalls a running stream for one pass at a time, not for all of them (six of 1,000 tokens once
    stalled every stream 16.6 s on gpt2-small, in one pass), and short ones share a pass. A prompt with edits
    runs alone, so that its edits cannot fail another's request. A dump run alone is the one its prompt gives,
    bit for bit; beside others, to float32's rounding. (A longer prompt joins the batch: the next test.)"""
    prompts = [[(7 * i + t) % 50000 for t in range(length)] for i in range(n)]
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    edits = EditSpec((Edit("blocks.0.hook_attn_out", "scale", factor=0.5),)) if edited else None
    log: list[tuple[str, int]] = []  # ("decode", rows) or ("pass", prompts in it), in the engine's order

    async def main() -> list[Completion]:
        with running(loaded, max_batch_size=8, prefill_chunk=16) as engine:
            step = engine._batch.step

            def decode() -> list[Any]:
                log.append(("decode", len(engine._batch)))
                return step()

            def on_pass(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                if args[0].shape[1] == length:  # x [B, T, C]: a pass over the prompts, not a decode token
                    log.append(("pass", args[0].shape[0]))

            engine._batch.step = decode  # type: ignore[method-assign]
            entered = engine.model.h[0].register_forward_pre_hook(on_pass)
            try:
                (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
                await first_event(stream)
                dumps = engine.submit(prompts, [SamplingParams(max_new_tokens=0)] * n, names, edits)
                results = [await d.result() for d in dumps]
                stream.cancel()
            finally:
                entered.remove()
            return results

    results = run(main())
    passes = [count for kind, count in log if kind == "pass"]
    assert passes == per_pass
    kinds = [kind for kind, _ in log]
    first, last = kinds.index("pass"), len(kinds) - 1 - kinds[::-1].index("pass")
    assert all(a != b for a, b in zip(kinds[first:last], kinds[first + 1 : last + 1], strict=True))  # alternate
    assert all(count == 1 for kind, count in log if kind == "decode")  # the stream, decoding throughout
    beside = [size > 1 for size in passes for _ in range(size)]  # prompt k ran beside others (in order)
    for k, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        alone = run_with_cache(loaded.model, prompt, names, edits.hooks(loaded.model.config, length) if edits else None)
        assert result.activations is not None and result.activations.keys() == alone.keys()
        for name, want in alone.items():
            if beside[k]:
                torch.testing.assert_close(result.activations[name], want, rtol=0, atol=1e-5)
            else:
                assert torch.equal(result.activations[name], want), name


@pytest.mark.parametrize(
    ("names", "edit", "in_chunks"),
    [
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], None, True),
        (["blocks.0.hook_resid_post", "logits"], None, True),
        (["hook_embed", "hook_pos_embed"], None, False),
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], "scale", True),
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], "set", True),
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], "pattern", True),
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], "ablation", True),
        (["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"], "mean", False),
    ],
    ids=[
        "to the last block",
        "to the head",
        "the embeddings",
        "edited",
        "set over the prompt",
        "a pattern's heads and queries",
        "residual ablation",
        "mean",
    ],
)
def test_a_prompt_to_dump_whose_pass_outweighs_a_chunk_is_prefilled_a_chunk_a_step(
    loaded: LoadedModel, names: list[str], edit: str | None, in_chunks: bool
) -> None:
    """A prompt that only dumps activations (40 tokens, chunks of 16, 2 blocks) whose pass to its last hook
    costs more than a chunk's through every block joins the batch and is prefilled a chunk a step beside the
    decoding stream, instead of holding it for that pass (1.2 s at 1,000 tokens of gpt2-small on a 2-core CPU
    to its last block, 2.2-2.6 s capturing every hook point), its edits applied to each chunk's positions (a
    `set` of a value for every prompt position takes each chunk's rows of it); one whose pass is cheap (the
    embeddings' hooks), or whose edits need the whole prompt at once (`mean`), keeps its one pass. The dump is
    the one its prompt gives alone, to float32's rounding."""
    prompt = [(7 * t + 2) % 50000 for t in range(40)]
    C = loaded.model.config.n_embd
    value = torch.linspace(-1, 1, 40 * C).reshape(40, C) if edit == "set" else None  # a row a position
    factor = 0.5 if edit == "scale" else None
    edits = EditSpec((Edit("blocks.0.hook_attn_out", edit, factor=factor, value=value),)) if edit else None
    if edit == "pattern":  # queries in each of the three chunks, their keys across them
        edits = EditSpec((Edit("blocks.0.attn.hook_pattern", "zero", heads=(0,), positions=(3, 20, 35)),))
    elif edit == "ablation":
        edits = EditSpec((), ablate_attn=(0,), ablate_mlp=(1,))
    widths: list[int] = []  # tokens of each pass that reaches the embeddings with more than one

    async def main() -> Completion:
        with running(loaded, max_batch_size=8, prefill_chunk=16) as engine:
            (stream,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
            await first_event(stream)

            def entered(_: Any, args: tuple[torch.Tensor, ...]) -> None:
                if args[0].numel() > 1:  # not the stream's own decode step, wherever that runs
                    widths.append(args[0].numel())

            hook = engine.model.wte.register_forward_pre_hook(entered)
            try:
                (dump,) = engine.submit([prompt], [SamplingParams(max_new_tokens=0)], names, edits)
                result = await dump.result()
                stream.cancel()
            finally:
                hook.remove()
            return result

    result = run(main())
    if in_chunks:
        assert widths == [2 + 16, 2 + 16, 2 + 8]  # a decode token a row (the stream's, its own dummy) + a chunk
    else:
        assert widths == [40]  # the whole prompt, in one pass
    alone = run_with_cache(loaded.model, prompt, names, edits.hooks(loaded.model.config, 40) if edits else None)
    assert result.activations is not None and result.activations.keys() == alone.keys()
    assert result.finish_reason == "length" and result.token_ids == []
    for name, want in alone.items():
        torch.testing.assert_close(result.activations[name], want, rtol=0, atol=1e-5)


def test_a_steps_tokens_reach_the_loop_in_one_call(loaded: LoadedModel) -> None:
    """Four sequences decoding together: each step's tokens (and the completions it ends) go to the event
    loop in one call, not one a token, and every stream still gets its own tokens in order."""
    prompts = [loaded.tokenizer.encode(text) for text in ("Hello", "The quick brown fox", "One two", "A")]
    calls: list[int] = []  # items per call into the loop from the engine's thread
    steps: list[int] = []

    async def main() -> list[Completion]:
        loop = asyncio.get_running_loop()
        real_call = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                calls.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return real_call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        with running(loaded, max_batch_size=4) as engine:
            real_step = engine._step_batch

            def step() -> None:
                steps.append(len(engine._batch))
                real_step()

            engine._step_batch = step  # type: ignore[method-assign]
            async with held(engine):  # all four admitted at once, then decoded side by side
                streams = engine.submit(prompts, [greedy_params(6, ignore_eos=True)] * 4)

            async def streamed(stream: RequestStream) -> tuple[list[int], Completion]:
                ids = [event.token_id async for event in stream]
                assert stream.completion is not None
                return ids, stream.completion

            return list(await asyncio.gather(*(streamed(s) for s in streams)))

    results = run(main())
    for prompt, (ids, result) in zip(prompts, results, strict=True):
        assert ids == result.token_ids == greedy(loaded, prompt, 6, ignore_eos=True).token_ids
    assert sum(calls) >= 4 * 6 + 4 + 1  # every token and completion, and the held job's result
    assert len(calls) <= sum(1 for n in steps if n) + 1  # at most one call a step, and one for the job
    assert max(calls) >= 4  # a step's four tokens together


def test_stop_fails_pending_requests(loaded: LoadedModel) -> None:
    async def main() -> None:
        engine = Engine(loaded, max_batch_size=1)
        engine.start()
        (running_one,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
        (waiting,) = engine.submit([[464]], [greedy_params(LONG, ignore_eos=True)])
        await first_event(running_one)
        await asyncio.to_thread(engine.stop)
        for stream in (running_one, waiting):
            with pytest.raises(EngineStopped):
                await stream.result()
        with pytest.raises(EngineStopped):
            engine.submit([[464]], [greedy_params(1)])
        with pytest.raises(EngineStopped):
            await engine.call(lambda m: None)

    run(main())
