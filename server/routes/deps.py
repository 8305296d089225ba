"""What the route handlers share: the engine and settings of the app, prompts turned into token ids,
and waiting on or streaming the engine's results."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from model.generate import Completion, GenerationError, TokenEvent, validate_prompt

from ..engine import Engine, RequestStream
from ..errors import APIError
from ..settings import Settings

log = logging.getLogger(__name__)


def get_engine(request: Request) -> Engine:
    engine: Engine | None = request.app.state.engine
    if engine is None:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    return engine


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def token_ids(engine: Engine, prompt: str | Sequence[Any] | None, input_ids: Sequence[Any] | None) -> list[list[int]]:
    """Token ids of each prompt, from `prompt` (text, or texts) or `input_ids` (ids, or lists of ids)."""
    if (prompt is None) == (input_ids is None):
        raise GenerationError("give exactly one of prompt and input_ids", "prompt")
    if input_ids is not None:
        ids = list(input_ids)
        if not ids:
            raise GenerationError("input_ids is empty", "input_ids")
        prompts = [list(x) for x in ids] if isinstance(ids[0], list) else [ids]
        for p in prompts:  # empty or out-of-vocabulary ids: name the field they came in
            validate_prompt(engine.model, p, 0, "input_ids")
        return prompts
    return openai_prompt_ids(engine, prompt)


def openai_prompt_ids(engine: Engine, prompt: str | Sequence[Any] | None) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of strings, a list of token ids or a list of lists of ids."""
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt)]
    items = list(prompt or [])
    if not items:
        raise GenerationError("the prompt list is empty", "prompt")
    if isinstance(items[0], str):
        return engine.tokenizer.encode_batch(items)
    if isinstance(items[0], int):
        return [items]
    return [list(x) for x in items]


async def results(streams: list[RequestStream]) -> list[Completion]:
    """Wait for every stream's completion (cancelling the others if one fails or the wait is cancelled)."""
    try:
        return list(await asyncio.gather(*(s.result() for s in streams)))
    finally:
        for s in streams:
            s.cancel()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[RequestStream, TokenEvent | None]]:
    """Events of several streams as they come; (stream, None) when a stream has finished."""
    queue: asyncio.Queue[tuple[RequestStream, TokenEvent | None] | BaseException] = asyncio.Queue()

    async def pump(stream: RequestStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((stream, event))
            queue.put_nowait((stream, None))
        except BaseException as e:  # delivered to the consumer, which re-raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        for _ in range(len(streams)):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item[1] is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.cancel()  # a client gone mid-stream frees its rows at the next step


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-Sent Events: one `data:` line of JSON per event, then `data: [DONE]`."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n".encode()
        except Exception as e:  # the status line is gone already: say it in the stream
            log.exception("stream failed", exc_info=e)
            error = {"type": "internal_error", "message": "generation failed; the stream ends here"}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
