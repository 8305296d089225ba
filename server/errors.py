"""Every error leaves as JSON `{"error": {"type", "message", "param"}}` with the right status; a 500
never carries a traceback (it is logged with the request id instead)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.generate import GenerationError
from model.hooks import UnknownHookError
from model.interventions import InterventionError

from .engine import EngineStopped, QueueFull

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"type": _TYPES.get(status, "error"), "message": message, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(GenerationError)
    async def generation_error(_: Request, e: GenerationError) -> JSONResponse:
        return error_response(400, str(e), e.param)

    @app.exception_handler(UnknownHookError)
    async def unknown_hook(_: Request, e: UnknownHookError) -> JSONResponse:
        return error_response(400, str(e), "activations.hooks")

    @app.exception_handler(InterventionError)
    async def bad_edit(_: Request, e: InterventionError) -> JSONResponse:
        return error_response(400, str(e), "interventions")

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return error_response(429, f"the server is busy: {e}; retry shortly", headers={"Retry-After": "1"})

    @app.exception_handler(EngineStopped)
    async def stopped(_: Request, e: EngineStopped) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
            )
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        messages = {
            400: "the body could not be parsed: send JSON encoded as UTF-8",
            404: "no such route",
            405: "method not allowed on this route",
        }
        return error_response(e.status_code, messages.get(e.status_code, str(e.detail)), headers=dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "?")
        log.exception("internal error (request %s)", request_id, exc_info=e)
        return error_response(500, f"internal server error (request id {request_id})")
