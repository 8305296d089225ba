"""The FastAPI application: routers, error handlers, the request guard, and the engine's lifetime.

`create_app(loaded=...)` serves a model that is already loaded (tests, embedding in another program);
`create_app(settings)` loads the model named in the settings on a background thread at start-up,
answering `/health` with 503 until it is ready. Either way `on_loaded` runs once the engine has started,
before it serves (`gpt2-serve` and Ray replicas freeze what is alive then: `freeze_long_lived`). `sliced`:
answers go out a slice at a time (`SlicedBodies`), for a server whose sends wait for the client (uvicorn's;
not Ray Serve's replicas, whose sends are queued at once).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.routing import BaseRoute, Mount, Route

from model.lab.sae import SAEError
from model.lab.steering import SharedVectors
from model.loading import LoadedModel, load_from

from .engine import Engine
from .errors import install_error_handlers
from .metrics import LIFESPAN_KEY, Metrics
from .middleware import CORS, RequestGuard, SlicedBodies
from .routes import gradients, lab, native, openai, ops, tokenizer
from .routes import sae as sae_routes
from .routes.deps import DumpBudget, GraphTurn
from .settings import Settings
from .threads import ReleaseOpenMP

log = logging.getLogger(__name__)

SETTLE_S = 5.0  # at shutdown, how long the requests cancelled at the end of the drain get to send their 503


def load_failure(error: Exception) -> str:
    """What failed as the server loaded: the model, or an SAE `--sae` names (whose error names it)."""
    return f"cannot load {'an SAE' if isinstance(error, SAEError) else 'the model'}: {error}"


def create_app(
    settings: Settings | None = None,
    *,
    loaded: LoadedModel | None = None,
    on_load_error: Callable[[Exception], None] | None = None,
    on_loaded: Callable[[], None] | None = None,
    sliced: bool = True,
    client_gone: tuple[type[Exception], ...] = (),
    shared_vectors: SharedVectors | None = None,
) -> FastAPI:
    """The app for `settings` (`loaded`: a model loaded already, else loaded in the background). `sliced`:
    answers go out a slice at a time, waiting for room (where sends can wait); `client_gone`: the errors the
    host raises into a request whose client has left (Ray's `TaskCancelledError`), logged as 499s;
    `shared_vectors`: where the steering vectors stored by name are kept with other servers' (a Ray
    deployment's replicas)."""
    settings = settings or Settings()
    metrics = Metrics()
    in_flight: set[asyncio.Task[Any]] = set()  # the requests' tasks (`RequestGuard`), until each is answered

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        if loaded is not None:
            app.state.directions = sae_routes.load_directions(settings, loaded, shared_vectors)
            engine = _start_engine(loaded, settings, metrics)
            _loaded(engine, on_loaded)
            app.state.engine = engine
        else:
            threading.Thread(target=_load_in_background, args=(app,), name="gpt2-loader", daemon=True).start()
        yield {LIFESPAN_KEY: metrics}
        # the requests a drain that ran out cancelled answer first (a 503, `DRAINING`): the engine's stop below
        # holds the event loop, and the process ends after it
        if in_flight:
            await asyncio.wait(set(in_flight), timeout=SETTLE_S)
        if app.state.engine is not None:
            app.state.engine.stop()

    def _load_in_background(app: FastAPI) -> None:
        try:
            model = load_from(settings)
            app.state.directions = sae_routes.load_directions(settings, model, shared_vectors)  # --sae: with it
            engine = _start_engine(model, settings, metrics)
            _loaded(engine, on_loaded)  # before the first request: /health says 503 until the engine is set
        except Exception as e:
            if on_load_error is None:
                log.error("%s", load_failure(e))
            else:  # which says it (gpt2-serve: as its last line, once)
                on_load_error(e)
            return
        app.state.engine = engine

    app = FastAPI(
        title="GPT-2 server",
        description="GPT-2 written from first principles: generation, activations, OpenAI-compatible API.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = None
    app.state.directions = sae_routes.server_directions(settings)
    app.state.dump_budget = DumpBudget(settings.dump_bytes_in_flight, settings.max_queue, metrics)
    app.state.graph_turn = GraphTurn(settings.max_queue)
    install_error_handlers(app)
    routers = (
        ops.router,
        native.router,
        openai.router,
        tokenizer.router,
        lab.router,
        gradients.router,
        sae_routes.router,
    )
    for router in routers:
        app.include_router(answer_head(router))
    app.mount("/static", StaticFiles(directory=lab.STATIC), name="static")
    app.add_middleware(ReleaseOpenMP)  # innermost: after the handler, before the guard's own bookkeeping
    if sliced:  # the handler waits while its answer goes out, a slice at a time (where sends wait for room)
        app.add_middleware(SlicedBodies)
    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        body_timeout=settings.body_timeout,
        client_gone=client_gone,
        routes=_routes(app, routers),
        in_flight=in_flight,
    )
    if settings.cors_origins:  # outermost, so that preflight requests need no API key
        app.add_middleware(
            CORS,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    return app


def _routes(app: FastAPI, routers: Sequence[APIRouter]) -> list[BaseRoute]:
    """Every route of the app, each with its path, for the guard to count a request it answers itself under the
    route it was sent to: the app's own (the docs, the static files' mount) and each router's. Newer FastAPI
    lists an included router in the app as one entry with no path (skipped); older ones list its routes there
    too, and a route listed twice only matches twice."""
    listed = [*app.router.routes, *(route for router in routers for route in router.routes)]
    return [route for route in listed if isinstance(route, (Route, Mount))]


def answer_head(router: APIRouter) -> APIRouter:
    """`router`, each of whose GET routes answers HEAD too (RFC 9110, section 9.3.2: health checkers and
    monitors send it), with the same status and headers and no body (uvicorn sends none): a HEAD route of its
    own beside each with the GET's dependencies and response settings, added once, left out of the OpenAPI
    schema (one route for both methods gave both the same operation id)."""
    routes = [route for route in router.routes if isinstance(route, APIRoute)]
    heads = {route.path for route in routes if "HEAD" in (route.methods or ())}
    for route in routes:
        if "GET" in (route.methods or ()) and route.path not in heads:
            router.add_api_route(
                route.path,
                route.endpoint,
                methods=["HEAD"],
                include_in_schema=False,
                response_model=route.response_model,
                response_class=route.response_class,
                status_code=route.status_code,
                dependencies=route.dependencies,
                response_model_include=route.response_model_include,
                response_model_exclude=route.response_model_exclude,
                response_model_by_alias=route.response_model_by_alias,
                response_model_exclude_unset=route.response_model_exclude_unset,
                response_model_exclude_defaults=route.response_model_exclude_defaults,
                response_model_exclude_none=route.response_model_exclude_none,
            )
    return router


def _loaded(engine: Engine, on_loaded: Callable[[], None] | None) -> None:
    """Run `on_loaded` for a started engine, which is stopped if it fails."""
    if on_loaded is None:
        return
    try:
        on_loaded()
    except BaseException:
        engine.stop()
        raise


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic garbage collector's way, for a process that serves one
    model for its whole life: once loaded, torch, the app and the model are some 330,000 objects that live as
    long as it, and a full collection walked them all, 0.2 s of the GIL on a 2-core CPU (every stream and the
    event loop waiting), whenever enough new objects had piled up (a 3.4 MB JSON body: parsing it took 0.6 s,
    now 0.1 s). Not for a process that loads models and lets them go (tests): what is frozen is never
    collected."""
    gc.collect()
    gc.freeze()


def _start_engine(loaded: LoadedModel, settings: Settings, metrics: Metrics) -> Engine:
    start = time.perf_counter()
    engine = Engine(
        loaded,
        max_batch_size=settings.max_batch_size,
        max_queue=settings.max_queue,
        prefill_chunk=settings.prefill_chunk,
        metrics=metrics,
    )
    engine.start()
    log.info(
        "serving %s (%s, %s): %d sequences at once, KV cache %.1f MiB, engine ready in %.1f s",
        loaded.name,
        loaded.device,
        str(loaded.dtype).removeprefix("torch.") + (f", {loaded.quantization} weights" if loaded.quantization else ""),
        settings.max_batch_size,
        engine.kv_cache_bytes / 2**20,
        time.perf_counter() - start,
    )
    return engine
