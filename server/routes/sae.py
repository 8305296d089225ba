"""Sparse-autoencoder features and steering vectors: `/v1/features` reads an SAE's features per token,
`/v1/steering-vectors` measures a contrastive mean difference (and keeps it by name for later edits).

The SAEs are loaded at start-up (`--sae ID=PATH`), never from a path a client names; the stored vectors
live in this process's memory (`Directions`, bounded by `--max-steering-vectors`; a Ray deployment's in one
store its replicas share, `server.ray_app.VectorStore`), never on disk."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from model.generate import GenerationError
from model.hooks import hook_names, is_glob, layer_of, reads_as_one_vector
from model.interventions import site_shape
from model.lab.sae import SAE, FeatureReading, TokenFeatures, load_saes
from model.lab.steering import (
    DirectionError,
    Directions,
    SharedVectors,
    contrast,
    prompt_pass,
    prompt_reduced,
)
from model.loading import LoadedModel

from .. import encoding
from ..engine import Engine
from ..errors import APIError
from ..json_body import JSONBodyRoute
from ..schemas import FeatureCapture, FeaturesRequest, SteeringVectorRequest
from ..settings import Settings
from ..threads import run_in_threadpool
from .deps import (
    DumpHoldDep,
    EngineDep,
    Held,
    SettingsDep,
    check_prompts,
    encode,
    json_response,
    prompt_field,
    resolved_edits,
    results,
    stepped,
    token_ids,
)

router = APIRouter(tags=["sae"], route_class=JSONBodyRoute)


def load_directions(settings: Settings, loaded: LoadedModel, shared: SharedVectors | None = None) -> Directions:
    """The SAEs the settings name (checked against the model, on its device) and the vector store (empty, or
    `shared` with other servers)."""
    return server_directions(settings, load_saes(settings.sae, loaded.model.config, loaded.device), shared)


def server_directions(
    settings: Settings, saes: dict[str, SAE] | None = None, shared: SharedVectors | None = None
) -> Directions:
    """`Directions` whose errors say how a server gets an SAE and stores a vector."""
    return Directions(
        saes,
        settings.max_steering_vectors,
        shared,
        load_hint="start the server with --sae ID=PATH",
        store_hint="POST /v1/steering-vectors with a name stores one",
    )


def get_directions(request: Request) -> Directions:
    directions: Directions = request.app.state.directions
    return directions


DirectionsDep = Annotated[Directions, Depends(get_directions)]


def describe_saes(directions: Directions) -> list[dict[str, Any]]:
    """What /v1/model lists of each SAE."""
    return [
        {
            "id": sae_id,
            "hook_name": sae.cfg.hook_name,
            "architecture": sae.cfg.architecture,
            "d_in": sae.cfg.d_in,
            "d_sae": sae.cfg.d_sae,
            "k": sae.cfg.k,
            "centred": sae.centred,
            "source": sae.source,
        }
        for sae_id, sae in directions.saes.items()
    ]


@dataclass(frozen=True)
class FeatureReader:
    """One request's SAE reading: which SAE, and the top k or the chosen features."""

    sae_id: str
    sae: SAE
    top_k: int | None
    ids: list[int] | None

    @property
    def hook(self) -> str:
        return self.sae.cfg.hook_name

    async def read(self, request: Request | None, engine: Engine, x: torch.Tensor) -> list[TokenFeatures]:
        """Per position of `x` [T, *site], the model's values at the SAE's hook, its features: read a part at a
        time, each an engine job (`stepped`: a client gone stops it; `request` None in a stream)."""
        reading = FeatureReading(self.sae, x, self.top_k, self.ids)
        await stepped(request, engine, reading, begun=True)  # the pass is done: not refused for a full queue
        return reading.rows

    @staticmethod
    def json(rows: list[TokenFeatures]) -> list[dict[str, Any]]:
        """`read`'s rows as the answer gives them (built off the event loop: 138 ms at 1,024 tokens of 1,024)."""
        return [_row(r) for r in rows]

    def _k_and_field(self) -> tuple[int, str]:
        """Features a position holds at most, and the field that chose them."""
        return (len(self.ids), "features") if self.ids is not None else (self.top_k or 0, "top_k")

    def check_size(self, n_tokens: int, wire: Literal["json", "safetensors"], limit: int, where: str = "") -> int:
        """413 when the reading of `n_tokens` positions, as sent, could exceed the server's limit on a dump
        (`--max-activation-bytes`): checked before the model runs. Else the bytes the reading holds until its
        answer is sent, as it reserves them from the dump budget: that answer's and the hook's capture's
        (`capture_bytes`)."""
        k, field = self._k_and_field()
        size = encoding.features_bytes_on_wire(n_tokens, k, wire)
        if size > limit:
            raise APIError(
                413,
                f"the SAE features ({k} per token over {n_tokens} tokens) would take up to {size} bytes as {wire}, "
                f"over the server's limit of {limit}: ask for fewer features, fewer tokens"
                + (" or format safetensors" if wire == "json" and not where else ""),
                where + field,
            )
        return size + self.capture_bytes(n_tokens)

    def capture_bytes(self, n_tokens: int) -> int:
        """The bytes of the SAE's hook captured over `n_tokens` positions (float32 [T, d_in]), held until the
        answer is built: most of what a reading holds (at gpt2-small's d_in, 13x its answer in JSON and 110x in
        safetensors at one feature a token, 6x and 40x at five)."""
        return n_tokens * self.sae.cfg.d_in * 4

    def held(self, where: str = "") -> Held:
        """What a request holds dump budget bytes for while its reading is served, as its 413 names it."""
        return Held("the SAE features", where + self._k_and_field()[1], "fewer features or fewer tokens")


def feature_reader(directions: Directions, spec: FeatureCapture | None, where: str = "") -> FeatureReader | None:
    """The reader a request's features spec asks for (None without one); a 400 for an unknown SAE, top_k
    or feature id, naming `where` + the field."""
    if spec is None:
        return None
    try:
        sae = directions.sae(spec.sae, where + "sae")
    except DirectionError as e:
        raise GenerationError(f"{where}sae: {e}", e.param) from None
    top_k, ids = spec.selection(sae.cfg.d_sae, where)
    return FeatureReader(spec.sae, sae, top_k, ids)


def _row(r: TokenFeatures) -> dict[str, Any]:
    return {
        "features": [{"id": i, "value": v} for i, v in r.features],
        "l0": r.l0,
        "mse": r.mse,
        "error_norm": r.error_norm,
        "variance_explained": r.variance_explained,
    }


@router.post("/v1/features", response_model=None)
async def features(
    req: FeaturesRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
) -> Response:
    reader = feature_reader(directions, req)
    assert reader is not None
    sae = reader.sae
    prompts = await token_ids(engine, req.prompt, req.input_ids)
    params = req.sampling_params(settings.max_new_tokens, engine.model.config.n_positions)
    check_prompts(engine, prompts, params.max_new_tokens, prompt_field(req.input_ids))
    n_tokens = len(prompts[0]) + params.max_new_tokens
    size = reader.check_size(n_tokens, req.format, settings.max_activation_bytes)
    edits = await resolved_edits(req, engine, directions)
    await hold.reserve(size, request, reader.held())  # held until the answer is sent
    (completion,) = await results(engine.submit(prompts, [params], [sae.cfg.hook_name], edits), request)
    assert completion.activations is not None
    x = completion.activations[sae.cfg.hook_name][0]  # [T, *site]: the SAE reads each position as [d_in]
    if not bool(x.isfinite().all()):
        raise GenerationError(
            f"the edits drove {sae.cfg.hook_name} to inf or NaN: no features to read", "interventions"
        )

    rows = await reader.read(request, engine, x)
    tokens = (completion.prompt_ids + completion.token_ids)[: x.shape[0]]
    text = engine.tokenizer.token_text
    body = {
        "model": engine.loaded.name,
        "sae": req.sae,
        "hook_name": sae.cfg.hook_name,
        "input_ids": tokens,
        "tokens": [text(t) for t in tokens],
        "prompt_tokens": len(completion.prompt_ids),
        "text": completion.text,
    }
    if req.format == "safetensors":
        blob = await run_in_threadpool(_file, rows, body)
        return Response(blob, media_type="application/octet-stream")
    return await json_response(lambda: body | {"features": FeatureReader.json(rows)})  # NaN, inf: null


def _file(rows: list[TokenFeatures], meta: dict[str, Any]) -> bytes:
    """The features as a safetensors file: `indices` and `values` [T, k] (k the most any token has; a top-k
    list shorter than k is padded with index -1 and value 0), and `l0`, `mse`, `variance_explained` [T] (`l0`
    -1 where the reading is not finite)."""
    from safetensors.torch import save

    k = max((len(r.features) for r in rows), default=0)
    indices = torch.full((len(rows), k), -1, dtype=torch.int64)
    values = torch.zeros(len(rows), k)
    for t, r in enumerate(rows):
        for j, (i, v) in enumerate(r.features):
            indices[t, j], values[t, j] = i, v
    nan = float("nan")
    return save(
        {
            "indices": indices,
            "values": values,
            "l0": torch.tensor([-1 if r.l0 is None else r.l0 for r in rows], dtype=torch.int64),  # -1: not finite
            "mse": torch.tensor([r.mse for r in rows]),
            "variance_explained": torch.tensor(
                [nan if r.variance_explained is None else r.variance_explained for r in rows]
            ),
        },
        {key: value if isinstance(value, str) else json.dumps(value) for key, value in meta.items()},
    )


def _not_a_vector_hook(hook: str, n_layer: int) -> str | None:
    """Why a steering vector cannot be read at `hook` of a model of `n_layer` blocks; None where it can."""
    layer = layer_of(hook)
    if is_glob(hook):
        return "is a glob: a steering vector is read at one hook point"
    if layer is not None and layer >= n_layer:
        return f"is past this model's blocks (0..{n_layer - 1})"
    if hook not in hook_names(n_layer):
        return "is no hook point of this model"
    if not reads_as_one_vector(hook):
        return "is not a hook with one vector per position"
    return None


@router.post("/v1/steering-vectors")
async def steering_vectors(
    req: SteeringVectorRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    directions: DirectionsDep,
    hold: DumpHoldDep,
) -> dict[str, Any]:
    req.check()
    config = engine.model.config
    if (why := _not_a_vector_hook(req.hook, config.n_layer)) is not None:
        raise GenerationError(
            f"hook {req.hook!r} {why}; give one with a vector per position, such as "
            f"blocks.{config.n_layer // 2}.hook_resid_pre, hook_resid_post, hook_attn_out, hook_mlp_out, or "
            "attn.hook_z, its heads read as one vector",
            "hook",
        )
    sides = [await _prompts(engine, getattr(req, side), side) for side in ("positive", "negative")]
    try:
        if req.name is not None:  # refused before the work if the store is full
            await directions.refresh()
            directions.check_room(req.name)
    except DirectionError as e:
        raise GenerationError(str(e), e.param) from None
    # a prompt's values at the hook are held from its pass to their reduction, while other requests' jobs run
    # between: against the dump budget, as a dump's, or concurrent requests would hold theirs all at once
    longest, param = max((len(ids), side) for side, ids in _each_prompt(sides))
    width, itemsize = math.prod(site_shape(req.hook, config)), engine.model.wte.weight.dtype.itemsize
    size = longest * width * (itemsize + (4 if itemsize < 4 else 0))  # and a float32 copy, narrower, as reduced
    if width > config.n_embd:  # logits, the MLP's hook_pre and hook_post
        what = Held(f"the values at {req.hook}", "hook", "shorter prompts or a hook of d_model values a position")
    else:
        what = Held(f"the values at {req.hook}", param, "shorter prompts")
    if size > settings.max_activation_bytes:
        raise APIError(
            413,
            f"{what.name} over the longest prompt would take {size} bytes while they are measured, over the "
            f"server's limit of {settings.max_activation_bytes}: ask for {what.smaller}",
            what.param,
        )
    await hold.reserve(size, request, what)  # held until the answer is sent

    values: list[list[torch.Tensor]] = [[], []]
    for side, prompts in zip(values, sides, strict=True):
        for ids in prompts:  # a job a block of each: the decode steps of running streams go on between them
            run = prompt_pass(config, ids, req.hook)
            await stepped(request, engine, run, begun=bool(values[0]))  # after the first prompt, not refused
            side.append(await run_in_threadpool(prompt_reduced, run, req.hook, req.reduce))  # a sync on a GPU
    vector = contrast(req.hook, values[0], values[1])
    if req.name is not None:
        try:
            await directions.publish(req.name, vector)
        except DirectionError as e:
            raise GenerationError(str(e), e.param) from None
    await directions.refresh()  # what the other replicas stored meanwhile, for "stored"
    return {
        "name": req.name,
        "hook": req.hook,
        "reduce": req.reduce,
        "n_positive": vector.n_positive,
        "n_negative": vector.n_negative,
        "norm": float(vector.vector.double().norm()),  # float32's squares overflow from entries of about 1e19
        "vector": vector.vector.tolist(),
        "stored": directions.names(),
    }


def _each_prompt(sides: list[list[list[int]]]) -> list[tuple[str, list[int]]]:
    """A contrast's prompts, each with its side's field."""
    return [(param, ids) for param, prompts in zip(("positive", "negative"), sides, strict=True) for ids in prompts]


async def _prompts(engine: EngineDep, prompts: list[str] | list[list[int]], param: str) -> list[list[int]]:
    if prompts and isinstance(prompts[0], str):
        ids = await encode(engine, [str(p) for p in prompts], param)
    else:
        ids = [list(p) for p in prompts if isinstance(p, list)]
    check_prompts(engine, ids, 0, param)
    return ids
