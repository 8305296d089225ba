"""Every error leaves as JSON `{"error": {"type", "message", "param", "code"}}` with the right status (`code`:
OpenAI's for the errors it has one for, else null); a 500 never carries a traceback (it is logged with the
request id instead)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, TypeGuard

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.generate import ContextLengthError, GenerationError
from model.hooks import UnknownHookError
from model.interventions import InterventionError
from model.json_file import clip

from .engine import EngineStopped, QueueFull
from .json_body import DuplicateKeyError, TooManyContainers, spelled

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_error",
    431: "request_header_fields_too_large",
    499: "client_closed_request",
    500: "internal_error",
    501: "not_implemented",
    503: "service_unavailable",
}


GONE = "the client closed the connection before the answer was ready"  # a 499's message: no one reads it


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers, code


class ClientLeft(APIError):
    """Work stopped because the request's client has gone (`server.middleware.client_left`): the 499 that no
    one reads, or, in a stream, its end."""

    def __init__(self) -> None:
        super().__init__(499, GONE)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """`{"error": {"type", "message", "param", "code"}}`, the shape of every error (also one sent mid-stream)."""
    param = None if param is None else printable(param)
    kind = _TYPES.get(status, "error")
    return {"error": {"type": kind, "message": printable(message), "param": param, "code": code}}


def generation_error_body(e: GenerationError) -> dict[str, Any]:
    """The error of a request that cannot be generated (`code` "context_length_exceeded" for one too long)."""
    return error_body(400, str(e), e.param, "context_length_exceeded" if isinstance(e, ContextLengthError) else None)


def printable(text: str) -> str:
    """`text` with any lone surrogate (from a client's JSON, echoed in a message) as a `\\udc80` escape:
    it has no UTF-8 bytes, so the answer could not be sent otherwise."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers, e.code)

    @app.exception_handler(GenerationError)
    async def generation_error(_: Request, e: GenerationError) -> JSONResponse:
        return JSONResponse(generation_error_body(e), status_code=400)

    @app.exception_handler(UnknownHookError)
    async def unknown_hook(_: Request, e: UnknownHookError) -> JSONResponse:
        return error_response(400, str(e), "activations.hooks")

    @app.exception_handler(InterventionError)
    async def bad_edit(_: Request, e: InterventionError) -> JSONResponse:
        return error_response(400, str(e), e.param)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return error_response(
            429, f"the server is busy: {e}; retry shortly", headers={"Retry-After": "1"}, code="rate_limit_exceeded"
        )

    @app.exception_handler(EngineStopped)
    async def stopped(_: Request, e: EngineStopped) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = [_in_body(error) for error in e.errors()]
        first = errors[0] if errors else {}
        loc = _path(first)
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
            )
        if not loc:
            return error_response(400, _body_problem(first.get("type"), request.headers.get("content-type")))
        return error_response(400, *validation_message(errors, e.body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 400 and isinstance(e.__cause__, DuplicateKeyError):  # raised in FastAPI's parse
            return error_response(400, str(e.__cause__), e.__cause__.param)
        messages = {
            400: _unparsable(e.__cause__),  # FastAPI's "error parsing the body", raised from the real cause
            404: "no such route",
            405: "method not allowed on this route",
        }
        headers = dict(e.headers or {})
        allow = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        if "GET" in allow and "HEAD" not in allow:  # every GET route has a HEAD twin (`app.answer_head`)
            headers["Allow"] = ", ".join([*allow, "HEAD"])
        return error_response(e.status_code, messages.get(e.status_code, str(e.detail)), headers=headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "?")
        log.exception("internal error (request %s)", request_id, exc_info=e)
        return error_response(500, f"internal server error (request id {request_id})")


def validation_message(errors: Sequence[Any], body: Any = None) -> tuple[str, str]:
    """The one message a body's validation errors make, and the field it names: the first error, in the form
    of a union it came closest to (`_union_error`), in a validator's own words. Also the command line's, for
    an edit given as JSON (`--steer`). `body`: what was validated, whose paths the messages follow (`_path`)."""
    first = errors[0]
    loc = _path(first, body)
    union = _union_error(errors, body)
    if union is not None:
        return union, spelled(loc[:1])
    message = _union_tag(first) or _not_an_object(first) or _past_float(first) or str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return (f"{spelled(loc)}: {message}" if loc else message), (spelled(loc[:1]) if loc else "body")


def _path(error: Any, body: Any = None) -> list[str | int]:
    """Where in the body a validation error is: list indices, and keys cut to a message's length (an unknown
    field's name is the client's, and can be megabytes long). A tagged union's tag, which pydantic puts in the
    path (`metric.logit_diff.tokens`), is left out where the object there holds it as a value, not as a key
    (`{"type": "logit_diff", "tokens": ...}`: the client's path is `metric.tokens`)."""
    parts: list[str | int] = []
    node = body
    loc = error.get("loc", ())
    for i, part in enumerate(loc):
        tag = i < len(loc) - 1 and isinstance(node, dict) and part not in node and part in node.values()
        if tag:  # (a missing field, last in its path, may be named like another field's value)
            continue
        parts.append(part if isinstance(part, int) else clip(str(part), str))
        node = node.get(part) if isinstance(node, dict) else _item(node, part)
    return parts


def _in_body(error: Any) -> Any:
    """A validation error of a request's body with its path from the body's root (FastAPI's begins "body")."""
    loc = tuple(error.get("loc", ()))
    return {**error, "loc": loc[1:]} if loc[:1] == ("body",) else error


def _item(node: Any, part: Any) -> Any:
    """A list's item at index `part`, or None where there is none."""
    if isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
        return node[part]
    return None


def _past_float(error: Any) -> str | None:
    """For a float given a JSON integer too large to be one (401 digits, say): why, in a short message that
    does not copy back its digits; else None."""
    given = error.get("input")
    if error.get("type") != "float_type" or not isinstance(given, int) or isinstance(given, bool):
        return None
    return f"an integer of {len(str(abs(given)))} digits is past a float's range (about 1.8e308)"


def _union_tag(error: Any) -> str | None:
    """For an object of a union told apart by one of its fields (a metric's `type`), missing or not one of the
    kinds: that, in a short message, not pydantic's "Unable to extract tag using discriminator"; else None."""
    ctx = error.get("ctx") or {}
    field = str(ctx.get("discriminator", "")).strip("'")
    if error.get("type") == "union_tag_not_found":
        return f"no {field!r}, which says what kind it is"
    if error.get("type") == "union_tag_invalid":
        return f"{field} {ctx.get('tag')!r} is none of the kinds: {ctx.get('expected_tags')}"
    return None


_OBJECT_TYPES = ("model_type", "model_attributes_type", "dict_type")  # pydantic's "a valid dictionary or instance of"


def _not_an_object(error: Any) -> str | None:
    """For a JSON object given something else: that, with what it was given, in words of JSON, not pydantic's
    "Input should be a valid dictionary or instance of InterventionSpec"; else None."""
    if error.get("type") not in _OBJECT_TYPES or "input" not in error:
        return None
    return f"must be an object ({{...}}), got {_json_kind(error['input'])}"


def _json_kind(value: Any) -> str:
    """What a value parsed from JSON is, in JSON's words."""
    for kinds, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), ((list, tuple), "a list")):
        if isinstance(value, kinds):
            return name
    return "null" if value is None else type(value).__name__


def _union_error(errors: Sequence[Any], body: Any = None) -> str | None:
    """Where the first error is one of a union's branches (pydantic puts the branch's name in the path,
    `prompt.list[int].0`): for an object given where objects are among the forms, the first error of the
    object form it came closest to (`direction.feature: Field required`); else the forms it fits none of.
    None where the first error is not in a union."""
    paths = [_path(error, body) for error in errors]
    first = paths[0]
    for i in range(1, len(first)):
        under = [(p, e) for p, e in zip(paths, errors, strict=True) if len(p) > i and p[:i] == first[:i]]
        parts = list(dict.fromkeys(p[i] for p, _ in under))
        tried = [t for t in parts if _is_type_name(t)]  # the union's forms, where every part is one
        if len(tried) < 2 or len(tried) < len(parts):
            continue
        field = spelled(first[:i])
        given_object = any(len(p) == i + 1 and isinstance(e.get("input"), dict) for p, e in under)
        objects = [t for t in tried if t[:1].isupper()]  # the model forms
        if given_object and objects:
            closest = min(objects, key=lambda t: sum(p[i] == t for p, _ in under))
            p, e = next((p, e) for p, e in under if p[i] == closest)
            return f"{spelled([*first[:i], *p[i + 1 :]])}: {e.get('msg', 'invalid value')}"
        past = _past_float(errors[0])  # the first error a float's, given 1e400 spelled out: said where it is
        if past:
            return f"{spelled([*first[:i], *first[i + 1 :]])}: {past}"
        return f"{field}: fits none of the forms it takes ({', '.join(tried)})"
    return None


def _is_type_name(part: str | int) -> TypeGuard[str]:
    """A union branch's name in an error's path (`str`, `list[int]`, `DumpValue`), not a field's (`hook`) or
    a list index."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper())


def _body_problem(error_type: str | None, content_type: str | None) -> str:
    """What is wrong with a body that failed validation as a whole."""
    if not _is_json(content_type):  # FastAPI did not read it as JSON at all
        given = f"it is {content_type!r}" if content_type else "there is none"
        return f"send the body as JSON with Content-Type: application/json ({given})"
    if error_type == "missing":
        return "the body is empty: send a JSON object"
    if error_type == "string_unicode":  # pydantic refuses keys that hold a lone surrogate
        return "the body holds a field name that is not valid Unicode (a lone surrogate)"
    return "the body must be a JSON object"


def _is_json(content_type: str | None) -> bool:
    """What FastAPI reads as JSON: application/json or application/*+json, with any parameters."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _unparsable(cause: BaseException | None) -> str:
    if isinstance(cause, TooManyContainers):
        return str(cause)
    if isinstance(cause, RecursionError):
        return "the body is nested too deeply to parse"
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8: {cause.reason} at byte {cause.start}; send JSON encoded as UTF-8"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # Python's guard on int()
        return f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits, too long to read"
    return "the body could not be parsed: send JSON encoded as UTF-8"
