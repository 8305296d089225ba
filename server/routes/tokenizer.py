"""Tokenizer endpoints in vLLM's shape (what lm-evaluation-harness and other clients probe for)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from model.generate import GenerationError
from model.json_file import clip
from model.tokenizer import EOT

from ..engine import Engine
from ..json_body import JSONBodyRoute
from ..schemas import DetokenizeRequest, TokenizeRequest
from .deps import EngineDep, SettingsDep, encode, json_response
from .openai import check_model

router = APIRouter(tags=["tokenizer"], route_class=JSONBodyRoute)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, engine: EngineDep, settings: SettingsDep) -> Response:
    check_model(req.model, engine, settings)
    # GPT-2 adds no special tokens, whatever add_special_tokens says
    (ids,) = await encode(engine, [req.prompt], "prompt", special=not req.split_special_tokens, prompts=False)
    # a body's worth of text is millions of tokens: their strings and the JSON on a worker thread
    return await json_response(_tokenized, engine, ids, req.return_token_strs)


def _tokenized(engine: Engine, ids: list[int], strs: bool) -> dict[str, Any]:
    pieces = [engine.tokenizer.piece(i) for i in ids] if strs else None
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.model.config.n_positions, "token_strs": pieces}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, engine: EngineDep, settings: SettingsDep) -> Response:
    check_model(req.model, engine, settings)
    vocab = engine.model.config.vocab_size  # the model's: one padded past the tokenizer's shows those as <|id:N|>
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"token id {clip(bad[0])} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return await json_response(lambda: {"prompt": engine.tokenizer.decode_batch([req.tokens])[0]})  # a body's worth


@router.get("/tokenizer_info")
async def tokenizer_info(engine: EngineDep) -> dict[str, Any]:
    tok = engine.tokenizer
    return {
        "tokenizer_class": "GPT2TokenizerFast",
        "eos_token": EOT,
        "eos_token_id": tok.eot_id,
        "bos_token": EOT,
        "bos_token_id": tok.eot_id,
        "pad_token": None,
        "unk_token": EOT,
        "vocab_size": tok.vocab_size,
        "model_max_length": engine.model.config.n_positions,
        "add_bos_token": False,
    }
