"""OpenAI-compatible API: `/v1/completions` (legacy completions, as evaluation harnesses use it) and
`/v1/models`. Response and stream chunks follow OpenAI's shapes exactly."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from model.generate import Completion, GenerationError, TokenLogprob

from ..engine import Engine, RequestStream
from ..schemas import CompletionRequest
from ..threads import run_in_threadpool
from .deps import EngineDep, SettingsDep, json_response, merged, openai_prompt_ids, results, sse

router = APIRouter(tags=["openai"])

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # the engine's name -> this API's


@router.get("/v1/models")
async def models(engine: EngineDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": engine.loaded.name,
                "object": "model",
                "created": 0,
                "owned_by": "openai-community",
                "max_model_len": engine.model.config.n_positions,
            }
        ],
    }


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    req.check()
    prompts = await openai_prompt_ids(engine, req.prompt)
    with _openai_names():
        streams = engine.submit(*req.sequences(prompts, engine.model.config.n_positions, settings.max_new_tokens))
    reply = _Reply(engine, req)
    if req.stream:
        return sse(reply.stream(streams))
    completions = await results(streams, request)
    return await json_response(reply.body, completions)


@contextmanager
def _openai_names() -> Iterator[None]:
    """The engine's errors name its own parameters: name this API's instead (max_tokens, not max_new_tokens)."""
    try:
        yield
    except GenerationError as e:
        if e.param not in OPENAI_NAMES:
            raise
        name = OPENAI_NAMES[e.param]
        raise GenerationError(str(e).replace(e.param, name), name) from None


class _Reply:
    def __init__(self, engine: Engine, req: CompletionRequest) -> None:
        self.engine, self.req = engine, req
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = req.model or engine.loaded.name

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _token(self, token_id: int) -> str:
        """A token as OpenAI shows it: its text, or `bytes:\\xNN...` for a piece of a multi-byte character
        (so distinct tokens never share a name)."""
        text = self.engine.tokenizer.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.engine.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")  # a real U+FFFD
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _logprobs(self, entries: list[TokenLogprob | None], ids: list[int], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object over tokens `ids` (`entries[i]` None where there is no logprob)."""
        decode = self.engine.tokenizer.decode
        offsets = [offset + len(decode(ids[:i])) for i in range(len(ids))]  # where each token starts in the text
        top: list[dict[str, float] | None] = []
        for lp in entries:
            if lp is None:
                top.append(None)
            else:  # the n most likely, and the chosen token (so up to n + 1 entries, as OpenAI does)
                top.append({self._token(i): v for i, v in [(lp.id, lp.logprob), *lp.top]})
        return {
            "tokens": [self._token(t) for t in ids],
            "token_logprobs": [None if lp is None else lp.logprob for lp in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def choice(self, i: int, c: Completion) -> dict[str, Any]:
        prompt_text = self.engine.tokenizer.decode(c.prompt_ids)
        echo = self.req.echo
        logprobs = None
        if self.req.logprobs is not None:
            entries: list[TokenLogprob | None] = list(c.logprobs or [])
            ids = list(c.token_ids)
            if echo:
                entries = list(c.prompt_logprobs or [None] * len(c.prompt_ids)) + entries
                ids = c.prompt_ids + ids
            logprobs = self._logprobs(entries, ids, 0 if echo else len(prompt_text))
        return {
            "index": i,
            "text": (prompt_text if echo else "") + c.text,
            "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[c.finish_reason],
        }

    def body(self, completions: list[Completion]) -> dict[str, Any]:
        return self._envelope([self.choice(i, c) for i, c in enumerate(completions)]) | {
            "usage": self._usage(completions)
        }

    def _usage(self, completions: list[Completion]) -> dict[str, int]:
        n = self.req.n
        prompt_tokens = sum(len(c.prompt_ids) for c in completions[::n])  # each prompt counted once
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[dict[str, Any]]:
        index = {id(s): i for i, s in enumerate(streams)}
        echoed: set[int] = set()
        async for stream, event in merged(streams):
            i = index[id(stream)]
            if self.req.echo and i not in echoed:
                echoed.add(i)
                yield self._envelope([await run_in_threadpool(self._echo_chunk, i, stream)])
            if event is not None:
                logprobs = None
                if self.req.logprobs is not None and event.logprob is not None:
                    logprobs = self._logprobs([event.logprob], [event.token_id], 0)
                yield self._envelope([{"index": i, "text": event.text, "logprobs": logprobs, "finish_reason": None}])
            else:
                assert stream.completion is not None
                reason = FINISH_REASONS[stream.completion.finish_reason]
                yield self._envelope([{"index": i, "text": "", "logprobs": None, "finish_reason": reason}])
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            done = [s.completion for s in streams if s.completion is not None]
            yield self._envelope([]) | {"usage": self._usage(done)}

    def _echo_chunk(self, i: int, stream: RequestStream) -> dict[str, Any]:
        """The prompt as the first chunk of choice i (decoding each prefix of it: call it on a worker thread)."""
        logprobs = None
        if self.req.logprobs is not None:
            entries = stream.prompt_logprobs or [None] * len(stream.prompt)
            logprobs = self._logprobs(list(entries), stream.prompt, 0)
        text = self.engine.tokenizer.decode(stream.prompt)
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}
