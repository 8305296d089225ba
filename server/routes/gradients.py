"""Gradients and attribution patching over HTTP: the metric's gradient at hook points (`/v1/gradients`) and
attribution scores for every site with optional real patching (`/v1/attribution`).

A gradient's pass runs a piece at a time (`MetricPass`: a block forward, a part of the LM head, a block
back), each piece a job on the engine's thread (`Engine.call`), decode steps between them; an attribution's
two runs go the same way (`ScoringPass`), then each site it verifies (`patched_pass`, without a graph). A
request's first job can meet a full queue (429), its later ones not (`stepped`). A pass holds its graph
from its first job to its last, and takes the server's `GraphTurn` for that: one graph alive at a time. A
graph estimated over the server's `--max-gradient-bytes` is refused with 413 before anything runs; the
gradients' answer, like a dump, holds its size of the server's dump budget (`--max-dump-bytes-in-flight`)
until it is sent."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from model.generate import validate_prompt
from model.interventions import EditSpec
from model.lab.attribution import ScoringPass, Site, patched_pass
from model.lab.gradients import Gradients, Metric, check_metric, grad_name, gradient_pass, graph_bytes

from .. import encoding
from ..engine import Engine
from ..errors import APIError
from ..json_body import JSONBodyRoute
from ..schemas import AttributionRequest, GradientsRequest
from ..settings import Settings
from ..threads import run_in_threadpool
from .deps import (
    GRADIENTS,
    DumpHoldDep,
    EngineDep,
    FileResponse,
    GraphTurnDep,
    SettingsDep,
    encode,
    json_response,
    prompt_field,
    resolved_edits,
    stepped,
    token_ids,
)
from .sae import DirectionsDep

router = APIRouter(tags=["lab"], route_class=JSONBodyRoute)


def check_graph(
    engine: Engine, settings: Settings, n_tokens: int, param: str, hooks: list[str], edits: EditSpec | None
) -> None:
    """Refuse (413, naming `param`) a request whose autograd graph, estimated from its shape, the hook points
    it captures (`hooks`) and those its `edits` change, would not fit."""
    config = engine.model.config
    edited = edits.plan(config).targets if edits is not None else ()  # planned already: no glob matched again
    quantized = engine.loaded.quantization is not None
    size = graph_bytes(config, n_tokens, engine.loaded.dtype, [*hooks, *edited], quantized)
    if size > settings.max_gradient_bytes:
        fixed = graph_bytes(config, 0, engine.loaded.dtype, quantized=quantized)  # int8's dequantized weights
        if fixed > settings.max_gradient_bytes:
            raise APIError(
                413,
                f"with int8 weights a graph takes about {fixed} bytes whatever the prompt (each product dequantizes "
                f"its weights for a moment), over the server's limit of {settings.max_gradient_bytes} "
                "(--max-gradient-bytes): no prompt fits; the server's operator can raise the limit or load float32",
                param,
            )
        split = size > graph_bytes(config, n_tokens, engine.loaded.dtype, quantized=quantized)
        raise APIError(
            413,
            f"a graph for {n_tokens} tokens would take about {size} bytes, over the server's limit of "
            f"{settings.max_gradient_bytes} (--max-gradient-bytes): send a shorter prompt"
            + (
                ", or capture or edit fewer per-head inputs (hook_attn_in, hook_q_input, hook_k_input, "
                "hook_v_input: n_head copies of the stream each)"
                if split
                else ""
            ),
            param,
        )


@router.post("/v1/gradients", responses={200: {"content": {"application/octet-stream": {}}}})
async def gradients_at_hooks(
    req: GradientsRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
    turn: GraphTurnDep,
) -> Response:
    (ids,) = await token_ids(engine, req.prompt, req.input_ids)
    param = prompt_field(req.input_ids)
    validate_prompt(engine.model, ids, 0, param)
    config = engine.model.config
    names = await run_in_threadpool(req.hook_names, config.n_layer)  # globs: matched off the event loop
    metric, edits = req.metric.metric(engine.tokenizer), await resolved_edits(req, engine, directions)
    check_metric(metric, len(ids), config.vocab_size)
    if edits is not None:
        edits.hooks(config, len(ids))  # a bad edit is refused here, before it takes the engine's time
    wire: encoding.Wire = "safetensors" if req.format == "safetensors" else "json"
    size = encoding.dump_bytes_on_wire(config, names, len(ids), "float32", wire)
    if size > settings.max_activation_bytes:
        raise APIError(
            413,
            f"the gradients would take up to {size} bytes as {wire}, over the server's limit of "
            f"{settings.max_activation_bytes}: ask for fewer hooks or fewer tokens"
            + (", or format safetensors" if wire == "json" else ""),
            "hooks",
        )
    check_graph(engine, settings, len(ids), param, names, edits)
    await hold.reserve(size, request, GRADIENTS)  # held until the answer is sent
    run = await run_in_threadpool(gradient_pass, config, ids, metric, names, edits)
    async with turn.held(request):
        await stepped(request, engine, run)
    result = run.result()
    del run  # its values at the hooks: as large as the answer, and not counted in the dump budget
    if wire == "json":
        return await json_response(_body, engine, ids, req.metric.type, metric, result)
    return await _file(engine, ids, req.metric.type, metric, result)


def _body(engine: Engine, ids: list[int], kind: str, metric: Metric, result: Gradients) -> dict[str, Any]:
    text = engine.tokenizer.token_text
    grads = {grad_name(n): g for n, g in result.grads.items()}
    return {
        "model": engine.loaded.name,
        "input_ids": ids,
        "tokens": [text(t) for t in ids],
        "metric": {"type": kind, "value": result.metric, **_metric_fields(metric)},
        "gradients": encoding.to_json(grads, "float32"),
    }


async def _file(engine: Engine, ids: list[int], kind: str, metric: Metric, result: Gradients) -> Response:
    meta = {
        "model": engine.loaded.name,
        "token_ids": ids,
        "metric": encoding.json_bytes({"type": kind, "value": result.metric, **_metric_fields(metric)}).decode(),
    }
    grads = {grad_name(n): g for n, g in result.grads.items()}
    return FileResponse(await run_in_threadpool(encoding.to_safetensors, grads, "float32", meta))


def _metric_fields(metric: Metric) -> dict[str, Any]:
    """The metric as resolved (token texts turned into ids)."""
    fields = dict(vars(metric))
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


@router.post("/v1/attribution")
async def attribution_patching(
    req: AttributionRequest, request: Request, engine: EngineDep, settings: SettingsDep, turn: GraphTurnDep
) -> dict[str, Any]:
    req.check()
    clean, corrupted = [
        await _prompt(engine, p, name) for p, name in ((req.clean, "clean"), (req.corrupted, "corrupted"))
    ]
    metric = req.metric.metric(engine.tokenizer)
    scoring = ScoringPass(engine.model.config, clean, corrupted, metric, req.verify)  # checks the prompts
    check_graph(engine, settings, len(corrupted), "corrupted", [], None)  # its sites split no input
    async with turn.held(request):
        await stepped(request, engine, scoring)
    scores = scoring.result()
    del scoring  # both runs' values at every site: only the verified sites' clean values go on
    verified = []
    for candidate in scores.candidates:  # no graph: no turn to wait for
        # its plan checks the clean value (a device sync on a GPU): off the event loop
        run = await run_in_threadpool(patched_pass, engine.model.config, clean, corrupted, metric, candidate)
        await stepped(request, engine, run, begun=True)  # the scores are in: not thrown away for a full queue
        verified.append(scores.verified(candidate, run.result().metric))
    result = scores.with_verified(verified)
    text = engine.tokenizer.token_text

    def site(s: Site) -> dict[str, Any]:
        return {"hook": s.hook, "layer": s.layer, "position": s.position, "head": s.head}

    return {
        "model": engine.loaded.name,
        "clean": {"input_ids": clean, "tokens": [text(t) for t in clean], "metric": result.clean_metric},
        "corrupted": {
            "input_ids": corrupted,
            "tokens": [text(t) for t in corrupted],
            "metric": result.corrupted_metric,
        },
        "metric": {"type": req.metric.type, **_metric_fields(metric)},
        "resid_pre": result.resid_pre.tolist(),  # [layer][position]
        "z": result.z.tolist(),  # [layer][head]
        "attn_out": result.attn_out.tolist(),  # [layer]
        "mlp_out": result.mlp_out.tolist(),  # [layer]
        "verified": [
            {
                "site": site(v.site),
                "attribution": v.attribution,
                "patched_metric": v.patched_metric,
                "patched_change": v.patched_change,
            }
            for v in result.verified
        ],
    }


async def _prompt(engine: Engine, prompt: str | list[int], param: str) -> list[int]:
    """Token ids of `prompt` (text, or ids), errors naming `param` (`clean`, `corrupted`)."""
    ids = (await encode(engine, [prompt], param))[0] if isinstance(prompt, str) else list(prompt)
    return validate_prompt(engine.model, ids, 0, param)
