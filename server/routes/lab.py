"""The residual-stream lab: layer-by-layer analysis, with and without residual connections, and the
viewer page that draws it (static files; it talks only to the public API)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from model.analysis import AnalysisPass, LayerStats
from model.config import GPTConfig
from model.generate import GenerationError, validate_prompt
from model.hooks import HEAD_HOOKS
from model.interventions import EditSpec, InterventionError, NonFiniteActivations
from model.lab.gradients import HighwayPass, LayerGradient

from .. import encoding
from ..errors import APIError
from ..json_body import JSONBodyRoute
from ..schemas import AnalyzeRequest
from ..threads import run_in_threadpool
from .deps import (
    DumpHoldDep,
    EngineDep,
    GraphTurnDep,
    Held,
    SettingsDep,
    prompt_field,
    resolved_edits,
    stepped,
    token_ids,
)
from .gradients import check_graph
from .sae import DirectionsDep

router = APIRouter(tags=["lab"], route_class=JSONBodyRoute)
STATIC = Path(__file__).resolve().parents[1] / "static"


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def viewer() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.api_route("/static/index.html", methods=["GET", "HEAD"], include_in_schema=False)
async def viewer_elsewhere() -> RedirectResponse:
    """The page where it works: its addresses are relative to `/` (to the prefix it is served under), so at
    /static/ every one of them would miss. The Location is relative too, for the same reason."""
    return RedirectResponse("../", status_code=308)


@router.post("/v1/analyze", response_model=None)
async def analyze_prompt(
    req: AnalyzeRequest,
    engine: EngineDep,
    request: Request,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
    turn: GraphTurnDep,
) -> Response:
    (ids,) = await token_ids(engine, req.prompt, req.input_ids)
    config = engine.model.config
    field = prompt_field(req.input_ids)
    validate_prompt(engine.model, ids, 0, field)
    most = min(100, config.vocab_size)  # a toy model's vocabulary may be smaller
    if not 1 <= req.top_k <= most:
        raise GenerationError(f"top_k must be in 1..{most}, got {req.top_k}", "top_k")

    def too_big(size: int | None, at_least: bool) -> APIError:
        """A 413 naming what would make the answer smaller: top_k, or else the prompt (`size` None: the answer
        went over the limit while it was being written)."""
        smaller = "a smaller top_k, a shorter prompt" if req.top_k > 1 else "a shorter prompt"
        takes = "more than the limit" if size is None else f"{'at least ' if at_least else ''}{size} bytes"
        return APIError(
            413,
            f"the analysis takes {takes} as JSON, over the server's limit "
            f"of {settings.max_activation_bytes}: ask for {smaller}"
            + (" or compare_ablated false" if req.compare_ablated else ""),
            "top_k" if req.top_k > 1 else field,
        )

    least = encoding.analysis_min_bytes(config, len(ids), req.top_k, 2 if req.compare_ablated else 1)
    if least > settings.max_activation_bytes:  # certainly over: refused before any model work
        raise too_big(least, at_least=True)
    edits = await resolved_edits(req, engine, directions)
    if edits is not None and not req.gradients:
        plan = edits.plan(config)  # made already, off the event loop (`resolved_edits`)
        plan.check_length(len(ids))  # an edit's own errors first (a position out of range)
        late = plan.only_at(HEAD_HOOKS)
        if late is not None:
            raise InterventionError(
                f"{plan.where(late)} applies only after the last block, which changes nothing "
                "/v1/analyze measures without gradients: the logit lens reads each layer's stream through ln_f and "
                'the unembedding as trained (as TransformerLens\' does); with "gradients": true it changes the '
                "highway's loss, and /v1/next-token applies it",
                "interventions",
            )
    everything = tuple(range(config.n_layer))
    no_residual = EditSpec(edits.edits if edits else (), everything, everything, edits.names if edits else ())

    if req.gradients:
        if len(ids) < 2:
            raise GenerationError("gradients need a prompt of at least 2 tokens (the loss predicts one)", "gradients")
        check_graph(engine, settings, len(ids), "gradients", [], edits)
    Run = tuple[list[LayerStats], list[LayerGradient] | None]
    # what the analysis holds between its jobs counts against the dump budget: concurrent analyses would
    # otherwise all hold theirs at once, the engine's jobs running first come first served
    runs, dtype = 2 if req.compare_ablated else 1, engine.model.wte.weight.dtype
    size = held_bytes(config, len(ids), req.top_k, runs, dtype, settings.max_activation_bytes)
    smaller = "a smaller top_k or a shorter prompt" if req.top_k > 1 else "a shorter prompt"
    smaller += ", or compare_ablated false" if req.compare_ablated else ""
    await hold.reserve(size, request, Held("the analysis", "top_k" if req.top_k > 1 else field, smaller))

    async def analysis(spec: EditSpec | None, begun: bool) -> list[LayerStats]:
        """One run's measures, a job a piece (`AnalysisPass`: a block of its pass, or a part of a layer's
        measures; a run's pass at 1,000 tokens of gpt2-small's shape on a CPU was once one job of about 4 s,
        every stream waiting; now its longest job takes about 0.4 s there). `begun`: the request has work done."""
        run = AnalysisPass(config, ids, req.top_k, spec.hooks(config, len(ids)) if spec else None)
        await stepped(request, engine, run, begun)
        return run.result()

    async def gradients(spec: EditSpec | None) -> list[LayerGradient]:
        """One run's gradient highway, a job a piece (`HighwayPass`), in the server's turn for a graph."""
        run = HighwayPass(config, ids, spec)
        async with turn.held(request):
            await stepped(request, engine, run, begun=True)  # after the analysis's own jobs
        return run.result()

    stats, ablated_stats = await analysis(edits, begun=False), None
    if req.compare_ablated:
        try:
            ablated_stats = await analysis(no_residual, begun=True)
        except NonFiniteActivations as e:  # say which run: the edits also apply to the one without skips
            raise NonFiniteActivations(f"{e}, in the run without residual connections (compare_ablated)") from None
    main: Run = (stats, await gradients(edits) if req.gradients else None)
    ablated: Run | None = None
    if ablated_stats is not None:
        ablated = (ablated_stats, await gradients(no_residual) if req.gradients else None)
    text = engine.tokenizer.token_text

    def layers(measured: Run, budget: list[int]) -> encoding.RawJSON:
        """A run's layers as JSON text, written a layer at a time (its dicts dropped once written) and each
        counted against what is left of the limit (`budget`): over it, the 413 comes before the rest is
        built, so building never holds much more than the limit."""
        stats, grads = measured
        pieces = [b"["]
        for n, s in enumerate(stats):
            encoding.unless_client_left()  # a layer's text at a time
            layer = layer_json(s, text)
            if grads is not None:  # the same layers, in the same order
                g = grads[n]
                layer |= {
                    "grad_norm": g.grad_norm,
                    "jacobian_norm": g.jacobian_norm,
                    "jacobian_identity_distance": g.jacobian_identity_distance,
                }
            pieces.append((b"," if n else b"") + encoding.json_bytes(layer))
            budget[0] -= len(pieces[-1])
            if budget[0] < 0:
                raise too_big(None, at_least=False)
        pieces.append(b"]")
        return encoding.RawJSON(pieces)

    def answer() -> bytes:
        budget = [settings.max_activation_bytes]
        body = encoding.json_bytes(
            {
                "model": engine.loaded.name,
                "input_ids": ids,
                "tokens": [text(t) for t in ids],
                "layers": layers(main, budget),
                "ablated": layers(ablated, budget) if ablated is not None else None,
            }
        )
        if len(body) > settings.max_activation_bytes:  # the rest of the answer: bounded by its real size
            raise too_big(len(body), at_least=False)
        return body

    body = await run_in_threadpool(answer)  # every token's text and the encoding off the event loop
    return Response(body, media_type="application/json")


def held_bytes(config: GPTConfig, n_tokens: int, top_k: int, runs: int, dtype: torch.dtype, limit: int) -> int:
    """What an analysis of `n_tokens` reserves from the dump budget: three residual streams [T, d_model] in the
    model's dtype (the one entering the next block, and at most two handed over to be measured), a float32
    copy of the one being measured where that dtype is narrower, and its answer's size in JSON, about, for its
    `runs` (`encoding.analysis_bytes`; at most `limit`, `--max-activation-bytes`, past which the answer is
    refused as it is written). As for a dump, that is the answer's size, not the few times as much that
    building it takes at its peak."""
    size = dtype.itemsize
    streams = n_tokens * config.n_embd * (3 * size + (4 if size < 4 else 0))
    return streams + min(limit, encoding.analysis_bytes(config, n_tokens, top_k, runs))


def layer_json(s: LayerStats, text: Callable[[int], str]) -> dict[str, Any]:
    """One layer's measures as `/v1/analyze` answers them (`text`: a token id's text, for the logit lens)."""
    return {
        "layer": s.layer,
        "norms": s.norms,
        "effective_rank": s.effective_rank,
        "collapse": s.collapse,
        "mean_cosine": s.mean_cosine,
        "attention_entropy": s.attention_entropy,
        "logit_lens": [[{"id": i, "token": text(i), "prob": p} for i, p in top] for top in s.logit_lens],
    }
