"""The native API: generation with logprobs and activation dumps, the next-token distribution, model info.

Answers that may carry an activation dump are encoded on a worker thread (`run_in_threadpool`): a dump of
hundreds of megabytes takes seconds to write, and the event loop keeps serving meanwhile."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from model import kernels
from model.analysis import NextTokenPass
from model.generate import Completion, GenerationError, TokenLogprob, validate_prompt
from model.hooks import is_optional, select_hooks
from model.lab.sae import TokenFeatures
from model.loading import LoadedModel

from .. import encoding
from ..engine import Engine
from ..errors import APIError
from ..json_body import JSONBodyRoute
from ..schemas import ActivationSpec, ActivationsRequest, GenerateRequest, NextTokenRequest
from ..settings import Settings
from ..threads import run_in_threadpool
from .deps import (
    DUMP,
    DUMP_AND_FEATURES,
    DumpHoldDep,
    EngineDep,
    FileResponse,
    SettingsDep,
    check_prompts,
    json_response,
    merged,
    places,
    prompt_field,
    resolved_edits,
    results,
    sse,
    stepped,
    token_ids,
)
from .sae import DirectionsDep, FeatureReader, describe_saes, feature_reader

router = APIRouter(tags=["native"], route_class=JSONBodyRoute)


def quantization_note(loaded: LoadedModel) -> str | None:
    """What /v1/model says of quantized weights (None for float weights): how the products run here."""
    if loaded.quantization is None:
        return None
    products = (
        f"on this CPU the products of up to {kernels.max_rows()} rows run on our kernels, which round each row of "
        "their input to int16, 15 bits, inside the product; longer ones and gradients dequantize the weights and "
        "multiply in float32"
        if loaded.device.type == "cpu" and kernels.available() and kernels.max_rows() > 0
        else "each product dequantizes its weights and multiplies in float32"
    )
    return (
        "weight-only int8: every projection and the LM head hold int8 weights with a float32 scale per output "
        f"channel; activations are float32 ({products}), so dumps hold the float32 activations of this quantized "
        "model, not of the original float32 weights"
    )


@router.get("/v1/model")
async def model_info(engine: EngineDep, directions: DirectionsDep) -> dict[str, Any]:
    await directions.refresh()
    c, loaded = engine.model.config, engine.loaded
    return {
        "name": loaded.name,
        "revision": loaded.revision,
        "dtype": str(loaded.dtype).removeprefix("torch."),  # of the activations (and dumps)
        "weights": loaded.weights,
        "quantization": quantization_note(loaded),
        "device": str(loaded.device),
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "d_model": c.n_embd,
        "d_head": c.d_head,
        "d_mlp": c.d_mlp,
        "n_ctx": c.n_positions,
        "vocab_size": c.vocab_size,
        "n_params": c.n_params(),
        "hook_names": engine.model.hook_names,
        "optional_hook_names": [n for n in engine.model.hook_names if is_optional(n)],
        "saes": describe_saes(directions),
        "steering_vectors": directions.names(),
    }


@router.post("/v1/generate")
async def generate(
    req: GenerateRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
) -> Response:
    prompts = await token_ids(engine, req.prompt, req.input_ids)
    params = req.sampling_params(settings.max_new_tokens, engine.model.config.n_positions)
    check_prompts(engine, prompts, params.max_new_tokens, prompt_field(req.input_ids))  # whatever the dump's size
    hooks, dump_bytes = await _checked_hooks(engine, settings, req.activations, prompts, params.max_new_tokens)
    reader = feature_reader(directions, req.features, "features.")  # SAE features: a capture of its hook
    what, feature_bytes = DUMP, 0
    if reader is not None:  # in JSON, for each choice
        n_tokens = sum(len(p) + params.max_new_tokens for p in prompts)
        feature_bytes = reader.check_size(n_tokens, "json", settings.max_activation_bytes, "features.")
        what = DUMP_AND_FEATURES if dump_bytes else reader.held("features.")
    edits = await resolved_edits(req, engine, directions)
    await hold.reserve(dump_bytes + feature_bytes, request, what)  # held until the answer is sent
    captured = hooks if reader is None else [*(hooks or []), reader.hook]
    # kept as the dump sends them, unless the SAE reads one of them (in the model's dtype)
    dtype = encoding.DTYPES[req.activations.dtype] if req.activations is not None and reader is None else None
    param = prompt_field(req.input_ids)
    streams = engine.submit(prompts, [params] * len(prompts), captured, edits, param, dtype, places(param, prompts))
    reply = _Reply(engine, req.activations, reader, hooks)
    if req.stream:
        return sse(reply.stream(merged(streams)))
    completions = await results(streams, request)
    for c in completions:
        await reply.read_features(c, request)
    return await json_response(reply.body, completions)


@router.post("/v1/activations", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
async def activations(
    req: ActivationsRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
) -> Response:
    if req.stream:
        raise GenerationError("/v1/activations answers with one file: stream is not supported", "stream")
    prompts = await token_ids(engine, req.prompt, req.input_ids)
    params = req.sampling_params(settings.max_new_tokens, engine.model.config.n_positions)
    param = prompt_field(req.input_ids)
    check_prompts(engine, prompts, params.max_new_tokens, param)
    if len(prompts) > 1:
        _check_stackable(prompts, params.max_new_tokens, param)
    spec = req.activations
    hooks, dump_bytes = await _checked_hooks(engine, settings, spec, prompts, params.max_new_tokens, file=True)
    edits = await resolved_edits(req, engine, directions)
    await hold.reserve(dump_bytes, request)  # held until the file is sent
    completions = await results(
        engine.submit(
            prompts, [params] * len(prompts), hooks, edits, param, encoding.DTYPES[spec.dtype], places(param, prompts)
        ),
        request,
    )
    pieces = await run_in_threadpool(_Reply(engine, None).file, completions, spec.dtype, req.batch())
    return FileResponse(pieces)


def _check_stackable(prompts: list[list[int]], max_new_tokens: int, param: str) -> None:
    """A batch's dumps are stacked along a leading batch dimension: one length for all, nothing generated."""
    if max_new_tokens:
        raise GenerationError(
            f"a batch of {len(prompts)} prompts gives their forward passes only: max_new_tokens must be 0, got "
            f"{max_new_tokens} (send one prompt per request to dump a generation)",
            "max_new_tokens",
        )
    lengths = sorted({len(p) for p in prompts})
    if len(lengths) > 1:
        raise GenerationError(
            f"the prompts of a batch must have one length, to stack into [batch, pos, ...]; got lengths "
            f"{lengths[0]} to {lengths[-1]} tokens",
            param,
        )


@router.post("/v1/next-token")
async def next_token(req: NextTokenRequest, engine: EngineDep, request: Request, directions: DirectionsDep) -> Response:
    (ids,) = await token_ids(engine, req.prompt, req.input_ids)
    vocab = engine.model.config.vocab_size
    if not 1 <= req.top_k <= vocab:
        raise GenerationError(f"top_k must be in 1..{vocab}, got {req.top_k}", "top_k")
    validate_prompt(engine.model, ids, 0, prompt_field(req.input_ids))
    edits = await resolved_edits(req, engine, directions)
    hooks = edits.hooks(engine.model.config, len(ids)) if edits is not None else None

    run = NextTokenPass(engine.model.config, ids, req.top_k, hooks)
    await stepped(request, engine, run)  # a block a job: decode steps go on between them
    dist = run.result()
    tok = engine.tokenizer

    def token_bytes(i: int) -> list[int] | None:  # a piece of a character shows as U+FFFD: its bytes tell them apart
        return list(tok.token_bytes(i)) if i < tok.vocab_size else None  # None: an id past the tokenizer's

    def body() -> dict[str, Any]:  # top_k may be the whole vocabulary: 50,257 entries, written off the event loop
        return {
            "model": engine.loaded.name,
            "input_ids": ids,
            "tokens": [tok.token_text(t) for t in ids],
            "top": [
                {"id": i, "token": tok.token_text(i), "bytes": token_bytes(i), "prob": math.exp(v), "logprob": v}
                for v, i in zip(dist.logprobs, dist.ids, strict=True)
            ],
            "entropy": dist.entropy,
        }

    return await json_response(body)


async def _checked_hooks(
    engine: Engine,
    settings: Settings,
    spec: ActivationSpec | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    file: bool = False,
) -> tuple[list[str] | None, int]:
    """The hook names a request asks for and the size of its dump as sent (`spec.format`, or a safetensors
    file when `file`), refused (413) when that exceeds the server's limit. Globs are matched on a worker thread
    (two thousand take a second on gpt2-xl's hook points)."""
    if spec is None:
        return None, 0
    names = await run_in_threadpool(select_hooks, spec.hooks, engine.model.config.n_layer)
    wire: encoding.Wire = "safetensors" if file else spec.format
    size = sum(
        encoding.dump_bytes_on_wire(engine.model.config, names, len(p) + max_new_tokens, spec.dtype, wire)
        for p in prompts
    )
    if size > settings.max_activation_bytes:
        smaller = ["fewer hooks", "fewer tokens"] + (["fewer prompts"] if len(prompts) > 1 else [])
        if spec.dtype == "float32":
            smaller.append("dtype float16 (half the bytes)")
        if wire == "json":
            smaller.append("format safetensors_base64 (about a quarter of JSON's size)")
        raise APIError(
            413,
            f"the activation dump would take up to {size} bytes as {wire}, over the server's limit of "
            f"{settings.max_activation_bytes}: ask for {', '.join(smaller[:-1])} or {smaller[-1]}",
            "activations",
        )
    return names, size


class _Reply:
    """Shapes completions into the native response and stream events."""

    def __init__(
        self,
        engine: Engine,
        spec: ActivationSpec | None,
        reader: FeatureReader | None = None,
        hooks: list[str] | None = None,
    ) -> None:
        """`reader`: the SAE features to add per choice; `hooks`: the activations the client asked for
        (the SAE's hook is captured for the reader, and left out of the dump unless asked for)."""
        self.engine, self.spec, self.reader = engine, spec, reader
        self.hooks = None if hooks is None else set(hooks)
        self.features: dict[int, list[TokenFeatures]] = {}  # each choice's, by its index, until it is sent
        self.id = "gen-" + uuid.uuid4().hex
        self.created = int(time.time())

    def _logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        token = self.engine.tokenizer.token_text(lp.id)
        return {"id": lp.id, "token": token, "logprob": lp.logprob, "top": self._top(lp)}

    def _top(self, lp: TokenLogprob) -> list[dict[str, Any]]:
        text = self.engine.tokenizer.token_text
        return [{"id": i, "token": text(i), "logprob": v} for i, v in lp.top]

    def choice(self, c: Completion) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "tokens": [self.engine.tokenizer.token_text(t) for t in c.token_ids],
            "finish_reason": c.finish_reason,
        }
        if c.logprobs is not None:
            out["logprobs"] = [self._logprob(lp) for lp in c.logprobs]
        if self.spec is not None and c.activations is not None:
            out["activations"] = self._activations(c)
        if c.index in self.features:
            out["features"] = FeatureReader.json(self.features.pop(c.index))
        return out

    async def read_features(self, c: Completion, request: Request | None) -> None:
        """The SAE features of `c`'s capture at the reader's hook, read on the engine a part at a time, before
        the answer is built (`request` None in a stream, whose end stops the reading)."""
        if self.reader is not None and c.activations is not None:
            x = c.activations[self.reader.hook][0]  # [T, *site]
            self.features[c.index] = await self.reader.read(request, self.engine, x)

    def _activations(self, c: Completion) -> Any:
        assert self.spec is not None and c.activations is not None
        acts = {name: t for name, t in c.activations.items() if self.hooks is None or name in self.hooks}
        if self.spec.format == "json":
            return encoding.to_json(acts, self.spec.dtype)
        meta: dict[str, Any] = {"model": self.engine.loaded.name, "weights": self.engine.loaded.weights}
        meta |= {"token_ids": c.prompt_ids + c.token_ids, "text": self._text(c)}
        return encoding.to_safetensors_base64(acts, self.spec.dtype, meta)

    def _text(self, c: Completion) -> str:
        """A dump's text: the prompt's, then the completion's."""
        return self.engine.tokenizer.decode(c.prompt_ids) + c.text

    def file(self, completions: list[Completion], dtype: str, batch: bool) -> list[bytes | memoryview]:
        """/v1/activations' answer: the dump as a safetensors file, its metadata holding the result. A
        `batch`'s tensors (prompts sent as a list, of one too) are stacked along their batch dimension, in the
        order of the prompts, and its token ids and texts are lists of one per prompt."""
        acts = [c.activations for c in completions]
        assert all(a is not None for a in acts)
        ids = [c.prompt_ids + c.token_ids for c in completions]
        texts = [self._text(c) for c in completions]
        meta = {
            "model": self.engine.loaded.name,
            "weights": self.engine.loaded.weights,
            "token_ids": ids if batch else ids[0],
            "text": json.dumps(texts) if batch else texts[0],
            "result": encoding.json_bytes(self.body(completions)).decode(),  # -inf as null: JSON, as the answer
        }
        tensors = {}
        for name in list(acts[0] or {}):  # a hook at a time, taken out of the completions: never held twice whole
            parts = [a.pop(name) for a in acts if a is not None]
            value = torch.cat(parts) if len(parts) > 1 else parts[0]  # (a batch of one: no copy)
            del parts
            tensors[name] = value.to(device="cpu", dtype=encoding.DTYPES[dtype])
        return encoding.to_safetensors(tensors, dtype, meta)

    def body(self, completions: list[Completion]) -> dict[str, Any]:
        prompt_tokens = sum(len(c.prompt_ids) for c in completions)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": self.id,
            "object": "generation",
            "created": self.created,
            "model": self.engine.loaded.name,
            "choices": [self.choice(c) for c in completions],
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    async def stream(self, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any] | bytes]:
        async for stream, event in events:
            if event is not None:
                lp = event.logprob
                yield {
                    "index": event.index,
                    "token_id": event.token_id,
                    "text": event.text,
                    "logprob": lp.logprob if lp is not None else None,
                    "top": self._top(lp) if lp is not None else None,
                    "finish_reason": None,
                }
                continue
            c = stream.completion
            final: dict[str, Any] = {
                "index": c.index,
                "text": "",
                "finish_reason": c.finish_reason,
                "usage": _usage(len(c.prompt_ids), len(c.token_ids)),
            }
            if (self.spec or self.reader) is not None and c.activations is not None:  # encoded off the event loop
                await self.read_features(c, None)
                yield await run_in_threadpool(self._final_json, final, c)
            else:
                yield final

    def _final_json(self, final: dict[str, Any], c: Completion) -> bytes:
        extra: dict[str, Any] = {}
        if self.spec is not None:
            extra["activations"] = self._activations(c)
        if c.index in self.features:
            extra["features"] = FeatureReader.json(self.features.pop(c.index))
        return encoding.json_bytes(final | extra)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
