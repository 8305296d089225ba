"""OpenAI-compatible API: `/v1/completions` (legacy completions, as evaluation harnesses use it) and
`/v1/models`. Response and stream chunks follow OpenAI's shapes exactly."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from model.generate import Completion, GenerationError, TokenLogprob
from model.json_file import clip
from model.loading import hub_repo
from model.tokenizer import Detokenizer, Tokenizer

from ..engine import Engine, RequestStream
from ..errors import APIError
from ..json_body import JSONBodyRoute
from ..schemas import CompletionRequest, StreamOptions, check_cap, valid_text
from ..settings import Settings
from ..threads import run_in_threadpool
from .deps import (
    EngineDep,
    SettingsDep,
    check_prompts,
    json_response,
    merged,
    openai_prompt_ids,
    places,
    results,
    sse,
)

router = APIRouter(tags=["openai"], route_class=JSONBodyRoute)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # the engine's name -> this API's


@router.get("/v1/models")
async def models(engine: EngineDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(engine, name) for name in served_names(engine, settings)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, engine: EngineDep, settings: SettingsDep) -> dict[str, Any]:
    """OpenAI's model retrieval: the served model by an id /v1/models lists (a local path's slashes too)."""
    check_served(model_id, engine, settings)  # "" too: no default here, unlike a request's `model`
    return _model_card(engine, model_id)


def served_names(engine: Engine, settings: Settings) -> tuple[str, ...]:
    """The names this API answers to: `--served-model-name`'s, else the model's as it was given."""
    return settings.served_model_name or (engine.loaded.name,)


def check_model(name: str | None, engine: Engine, settings: Settings) -> None:
    """A request's `model`: None or "" is the served model, as vLLM takes them; any other name is checked
    (`check_served`)."""
    if name:
        check_served(name, engine, settings)


def check_served(name: str, engine: Engine, settings: Settings) -> None:
    """A model this server does not serve is a 404, as OpenAI and vLLM answer it: never another model's text
    (or its tokenizer's ids) under the name asked for. A name that is not valid Unicode (a lone surrogate) is a
    400: it could not be echoed back."""
    valid_text(name, "model")
    names = served_names(engine, settings)
    if name not in names:
        served = ", ".join(repr(n) for n in names)
        message = f"the model {clip(name)} does not exist: this server serves {served}"
        raise APIError(404, message, "model", code="model_not_found")


def _model_card(engine: Engine, name: str) -> dict[str, Any]:
    loaded = engine.loaded.name
    repo = None if Path(loaded).expanduser().exists() else hub_repo(loaded)  # as `locate` read the name
    owner = repo.partition("/")[0] if repo is not None else "local"
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": owner,
        "max_model_len": engine.model.config.n_positions,
    }


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, engine: EngineDep, settings: SettingsDep) -> Response:
    req.check()
    check_model(req.model, engine, settings)
    # an empty or missing prompt is <|endoftext|>, as OpenAI reads it: "as from the beginning of a new document"
    eot = engine.tokenizer.eot_id
    prompts = [ids or [eot] for ids in await openai_prompt_ids(engine, req.prompt or "")]
    n_ctx = engine.model.config.n_positions
    with _openai_names():
        if req.max_tokens is not None:  # the server's cap first, as /v1/generate checks it
            check_cap(req.max_tokens, settings.max_new_tokens, "max_tokens", n_ctx)
        # each prompt before the n samples are laid out (counted already); max_tokens null fits each
        check_prompts(engine, prompts, req.max_tokens or 0, "prompt")
        sequences = req.sequences(prompts, n_ctx, settings.max_new_tokens)
        labels = places("prompt", prompts, req.n)
        streams = engine.submit(*sequences, count_param="n" if req.n > 1 else "prompt", labels=labels)
    reply = _Reply(engine, req, req.model or served_names(engine, settings)[0])
    if req.stream:
        return sse(reply.stream(streams))
    completions = await results(streams, request)
    return await json_response(reply.body, completions)


@router.post("/v1/chat/completions")
async def chat_completions() -> Response:
    """GPT-2 has no chat format: answered as OpenAI answers a chat request for a completions model."""
    message = (
        "This is not a chat model and thus not supported in the v1/chat/completions endpoint. "
        "Did you mean to use v1/completions?"
    )
    raise APIError(404, message, "model")


@contextmanager
def _openai_names() -> Iterator[None]:
    """The engine's errors name its own parameters: name this API's instead (max_tokens, not max_new_tokens)."""
    try:
        yield
    except GenerationError as e:
        if e.param not in OPENAI_NAMES:
            raise
        name = OPENAI_NAMES[e.param]
        raise type(e)(str(e).replace(e.param, name), name) from None  # of its kind: a ContextLengthError stays one


class _Reply:
    def __init__(self, engine: Engine, req: CompletionRequest, model: str) -> None:
        self.engine, self.req, self.model = engine, req, model
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _token(self, token_id: int) -> str:
        """A token as OpenAI shows it: its text, or `bytes:\\xNN...` for a piece of a multi-byte character, or
        `<|id:N|>` for an id the tokenizer does not know (a vocabulary padded past it, as nanoGPT pads to
        50304), so distinct tokens never share a name; `token_id:N` for each token if the request asks so."""
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.engine.tokenizer.token_name(token_id)

    def _logprobs(self, entries: list[TokenLogprob | None], ids: list[int], offsets: _TextOffsets) -> dict[str, Any]:
        """OpenAI's logprobs object over tokens `ids`, the next ones of the choice whose `offsets` these are
        (`entries[i]` None where there is no logprob)."""
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
            "text_offset": offsets.take(ids),
        }

    def choice(self, i: int, c: Completion) -> dict[str, Any]:
        prompt_text = self.engine.tokenizer.decode(c.prompt_ids)
        echo = self.req.echo
        logprobs = None
        if self.req.logprobs is not None:
            tok = self.engine.tokenizer
            logprobs = self._logprobs(list(c.logprobs or []), list(c.token_ids), _TextOffsets(tok, len(prompt_text)))
            if echo:  # the prompt's offsets in its own text, then the completion's after it (`_TextOffsets`)
                entries = list(c.prompt_logprobs or [None] * len(c.prompt_ids))
                echoed = self._logprobs(entries, c.prompt_ids, _TextOffsets(tok))
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
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
        offsets: dict[int, _TextOffsets] = {}  # per choice, from its first event on
        options = self.req.stream_options or StreamOptions()
        continuous = bool(options.continuous_usage_stats)
        usage = continuous if options.include_usage is None else options.include_usage  # vLLM's default, with it
        continuous = continuous and usage  # include_usage false: none at all, as vLLM has it
        generated = [0] * len(streams)  # per choice, its tokens so far

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            """With usage asked for, null until the last chunk; with vLLM's continuous usage, the choice's own
            so far (its prompt's tokens, and the tokens it has generated)."""
            if not continuous:
                return self._envelope(choices) | ({"usage": None} if usage else {})
            (choice,) = choices
            prompt, done = len(streams[choice["index"]].prompt), generated[choice["index"]]
            counts = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            return self._envelope(choices) | {"usage": counts}

        async for stream, event in merged(streams):
            i = index[id(stream)]
            if (self.req.echo or self.req.logprobs is not None) and i not in offsets:
                offsets[i], echoed = await run_in_threadpool(self._prompt, i, stream)
                if echoed is not None:
                    yield chunk([echoed])
            if event is not None:
                generated[i] += 1
                logprobs = None
                if self.req.logprobs is not None and event.logprob is not None:
                    logprobs = self._logprobs([event.logprob], [event.token_id], offsets[i])
                yield chunk([{"index": i, "text": event.text, "logprobs": logprobs, "finish_reason": None}])
            else:
                assert stream.completion is not None
                reason = FINISH_REASONS[stream.completion.finish_reason]
                yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": reason}])
        if usage:
            done = [s.completion for s in streams if s.completion is not None]
            yield self._envelope([]) | {"usage": self._usage(done)}

    def _prompt(self, i: int, stream: RequestStream) -> tuple[_TextOffsets, dict[str, Any] | None]:
        """Choice i's text offsets past its prompt and, with echo, the prompt as its first chunk (decoding
        the prompt: call it on a worker thread)."""
        tok = self.engine.tokenizer
        text = tok.decode(stream.prompt)
        if not self.req.echo:
            return _TextOffsets(tok, len(text)), None
        logprobs = None
        if self.req.logprobs is not None:
            entries = stream.prompt_logprobs or [None] * len(stream.prompt)
            logprobs = self._logprobs(list(entries), stream.prompt, _TextOffsets(tok))
        return _TextOffsets(tok, len(text)), {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}


class _TextOffsets:
    """OpenAI's `text_offset` of a choice's tokens, one after another: where each starts in the text, that
    is the length of the text the tokens before it decode to, after `start` characters. The prompt and the
    completion are each decoded on their own, as the choice's text is made of them (so a character split
    between the prompt's last token and the first generated one shows as U+FFFD on both sides, and the
    offsets still index that text). A token costs the same at any length (`Detokenizer`), and a stream's
    offsets equal the whole answer's."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0) -> None:
        self._text = Detokenizer(tokenizer)
        self._start = start

    def take(self, ids: list[int]) -> list[int]:
        """The offsets of the next tokens, `ids`."""
        offsets = []
        for token_id in ids:
            offsets.append(self._start + len(self._text))
            self._text.add(token_id)
        return offsets
