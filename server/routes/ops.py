"""Operations: readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    if engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if not engine.running:  # its thread ended (a stop, or a bug): every request would get a 503
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
