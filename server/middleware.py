"""What every request passes through: a request id, the API key, the body-size cap, one log line, metrics;
and CORS, when it is configured.

Written as plain ASGI (not BaseHTTPMiddleware) so that streamed responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.json_file import clip

from .asgi import HTTPOnly
from .errors import GONE, error_response
from .metrics import Metrics

log = logging.getLogger("server.access")

OPEN_PATHS = frozenset({"/health", "/"})  # answered without an API key (with /static/: the viewer's files)
# An incoming X-Request-ID is echoed and logged only if it is this short and printable: 1..128 visible
# ASCII characters. Any other (a huge one, control characters) is replaced by a fresh id.
REQUEST_ID = re.compile(r"[!-~]{1,128}")
# A request target in absolute form (RFC 9112, section 3.2.2): a scheme and an authority before the path.
ABSOLUTE_FORM = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")

# A scope key the connection layer (`server.connections`) sets on a request it refuses, with the reason: the
# guard answers it 503, so that the refusal carries a request id and is logged and counted like any answer.
REFUSAL = "gpt2.refusal"
# A scope key it sets on a request past the cap that it serves all the same (/health): its answer closes the
# connection, so that the cap still bounds the connections a client can hold open.
CLOSE = "gpt2.close"
# A scope key it sets on the requests in flight when gpt2-serve begins to shut down: a task uvicorn cancels at
# the end of the drain (`--drain-timeout`) is then cut by the shutdown, not given up by its client (Ray Serve's
# cancellation), and the guard answers it 503 in the API's shape rather than let uvicorn answer a bare 500.
DRAINING = "gpt2.draining"
DRAINED = "the server is shutting down, and the request did not finish within its drain timeout (--drain-timeout)"
# A scope key it sets on a request whose body h11 could not read (a bad chunk size, a chunk longer than it
# said): it answered 400 itself and closed the connection, so the guard, which then sees the client gone (or
# refuses the request unread, a 401), counts and logs the request as that 400.
MALFORMED = "gpt2.malformed"
# A scope key it sets when a request's connection is lost after its answer began and before it ended, with why:
# "client_left", or "write_timeout" (it dropped a client that took none of the answer in `--write-timeout`).
# Such an answer keeps the status it was sent with; the guard logs it with `"cut": why` and counts it in
# gpt2_answers_cut_total (where a host cancels the request, "client_left"; the shutdown's drain, "drain").
CUT = "gpt2.cut"
# A scope key it sets when a request's connection is lost before its answer began. No one reads what the app
# answers after that (uvicorn drops it), so the guard logs and counts the request as 499, as it does where the
# app saw the client go: work that does not watch for it, such as an answer built on a worker thread, would
# otherwise be logged with the status of an answer never sent.
LEFT = "gpt2.left"
# The request a task answers (the guard sets it): the task's work, and what it runs on worker threads (in a
# copy of its context), can ask whether its client has left (`client_left`).
_REQUEST: ContextVar[Scope | None] = ContextVar("gpt2_request", default=None)


def client_left() -> bool:
    """Whether the client of the request being answered has left, before its answer began (`LEFT`) or during
    it (`CUT`): what the request still does is for no one. (Known as it happens where the connection layer is
    gpt2-serve's; under Ray Serve's, only a cut, once the host has given the request up.)"""
    scope = _REQUEST.get()
    return scope is not None and bool(scope.get(LEFT) or scope.get(CUT))


def request_id_of(scope: Scope) -> str:
    """The request's id: its X-Request-Id where that is printable ASCII of up to 128 characters, else a new
    one. Made once and kept in the scope's state: the connection layer can need it first, for an answer it
    writes itself (a body h11 cannot read, `MALFORMED`), before the guard has run."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        given = ""
        for key, value in scope["headers"]:  # the last, as a dict of the headers keeps it
            if key.lower() == b"x-request-id":
                given = value.decode("latin-1")
        state["request_id"] = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    return str(state["request_id"])


def origin_form(scope: Scope) -> None:
    """Take a request target in absolute form (`GET http://host/health HTTP/1.1`, as a client set up for a
    proxy sends it) by its path, and its authority as the host: RFC 9112, section 3.2.2, says a server MUST
    accept it and ignore `Host` then. uvicorn puts the whole target in `raw_path` and `path`, so every route
    was a 404; the path is derived again from what follows the authority, as uvicorn derives it."""
    raw: bytes = scope.get("raw_path") or b""
    found = ABSOLUTE_FORM.match(raw)
    if found is None:
        return
    scope["raw_path"] = raw[found.end() :] or b"/"
    scope["path"] = unquote(scope["raw_path"].decode("latin-1"))
    host = found.group(1).rpartition(b"@")[2]  # without any userinfo
    if host:
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"] + [(b"host", host)]


def app_path(scope: Scope) -> str:
    """The request's path within the app: without the prefix it is mounted at (`root_path`: a Ray Serve
    route prefix, a proxy's), which ASGI servers include in `path`."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root.rstrip("/")) :] or "/"
    return path


class CORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in this API's error shape (not plain text). A
    preflight the connection layer refused (`REFUSAL`) goes straight on to the guard, whose answer is the 503
    (CORS would answer it itself); any other refused request goes through CORS as usual, so its 503 carries
    the CORS headers a browser needs to read it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and REFUSAL in scope and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:  # a preflight
                await self.app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        reason = bytes(response.body).decode()  # e.g. "Disallowed CORS origin, method"
        headers = {k: v for k, v in response.headers.items() if k.startswith("access-control-")}
        return error_response(400, f"the CORS preflight was refused: {reason}", headers=headers)


class Sparse:
    """A warning said at most once every `seconds` (a flood of refusals is one line, not hundreds a second),
    with how many like it were held back since the last one said."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.last = -math.inf
        self.held = 0

    def warning(self, message: str) -> bool:
        """Log `message` unless one was logged within `seconds`; returns whether it did."""
        now = self.clock()
        if now - self.last < self.seconds:
            self.held += 1
            return False
        more = f" (and {self.held} more like it in the {now - self.last:.0f} s before)" if self.held else ""
        log.warning("%s%s", message, more)
        self.last, self.held = now, 0
        return True


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        body_timeout: float = math.inf,
        client_gone: tuple[type[Exception], ...] = (),
        routes: Sequence[BaseRoute] = (),
        in_flight: set[asyncio.Task[Any]] | None = None,
    ) -> None:
        self.app = app
        self.in_flight = in_flight if in_flight is not None else set()  # the requests' tasks, until answered
        self.refusals = Sparse(10.0)  # the connection cap's: one line every 10 s at most (each is in the access log)
        self.routes = routes  # the app's, to count a request the guard answers under its route
        self.client_gone = client_gone  # errors a host raises into a request whose client has left
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.body_timeout = body_timeout  # seconds for the whole body, from the moment the app sees the request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        _REQUEST.set(scope)  # in this request's task, which has a context of its own
        origin_form(scope)
        # what the request was sent to, for the metrics, kept as it came (a Mount rewrites its scope's root_path)
        target = {key: scope[key] for key in ("type", "method", "path", "root_path") if key in scope}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = request_id_of(scope)
        status = 500
        started = False
        task = asyncio.current_task()
        assert task is not None  # a request runs in a task of its own

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
                if scope.get(CLOSE):
                    message["headers"].append((b"connection", b"close"))
            await send(message)

        try:
            self.in_flight.add(task)
            refusal = scope.get(REFUSAL)
            if refusal is not None:
                self.refusals.warning(f"{refusal}: answering 503 (request {request_id})")
                rejection = error_response(503, refusal, headers={"Retry-After": "1", "Connection": "close"})
            else:
                rejection = (
                    _framing(headers) or self._check_key(app_path(scope), scope["headers"]) or _coding(scope, headers)
                )
            if rejection is None:
                try:
                    receive, rejection = await self._bounded_body(headers, receive)
                except asyncio.CancelledError:  # the host gave the request up while its body came (Ray Serve)
                    status = 499
                    raise
                except self.client_gone:  # as the app's own below: the 499 that says no one reads the answer
                    status = 499
                    with contextlib.suppress(Exception):
                        await error_response(499, GONE)(scope, receive, send_with_id)
                    return
            if rejection is not None:
                await rejection(scope, receive, send_with_id)
            else:
                try:
                    await self.app(scope, receive, send_with_id)
                except asyncio.CancelledError:  # the host gave the request up (Ray Serve: its client left)
                    status = status if started else 499
                    if started:
                        scope.setdefault(CUT, "client_left")
                    raise
                except self.client_gone:  # no one reads the answer (the 499 that says so), nor a stream's end
                    if started:
                        scope.setdefault(CUT, "client_left")
                    else:
                        gone = error_response(499, GONE)
                        with contextlib.suppress(Exception):
                            await gone(scope, receive, send_with_id)
                except Exception:
                    if started:
                        raise
                    # Answered here rather than by the app's outermost handler, so the 500 carries the id too.
                    log.exception("internal error (request %s)", request_id)
                    failed = error_response(500, f"internal server error (request id {request_id})")
                    await failed(scope, receive, send_with_id)
        except asyncio.CancelledError:  # or the shutdown's drain ended (`DRAINING`): the cancellation ends here
            if not scope.get(DRAINING):
                raise
            log.warning("request %s: cut by the shutdown at the end of its drain timeout", request_id)
            if started:  # a stream already under way is cut (its connection closes, no end marker)
                scope[CUT] = "drain"
            else:
                drained = error_response(503, DRAINED, headers={"Connection": "close"})
                with contextlib.suppress(Exception):
                    await drained(scope, receive, send_with_id)
        finally:
            self.in_flight.discard(task)
            if scope.get(MALFORMED):  # answered 400 by the connection layer, whatever was sent after it
                status = 400
            elif scope.get(LEFT):  # the client left before the answer began: no one read it
                status = 499
            route = self._route(scope.get("route"), target)
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            line: dict[str, Any] = {
                "request_id": request_id,
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "duration_ms": round((time.perf_counter() - start) * 1000, 1),
            }
            cut = scope.get(CUT)  # (one cut before it began is answered with a status that says so: 499, 503)
            if cut is not None:
                line["cut"] = cut
                self.metrics.answers_cut.labels(route=route, reason=cut).inc()
            log.info(json.dumps(line))

    def _route(self, route: BaseRoute | None, target: Scope) -> str:
        """The route a request is counted under: `route`, the one that answered it, or where none did (the
        guard answered itself: a 400, 401, 408, 413, 415, 499 or 503; a static file's mount) the one `target`
        (the request's path and method, as they came) was sent to; "unmatched" for a path no route has, so that
        made-up paths cannot grow the metrics without bound."""
        if route is None:
            matches = [(r.matches(target)[0], r) for r in self.routes]
            route = next((r for match in (Match.FULL, Match.PARTIAL) for m, r in matches if m == match), None)
        return getattr(route, "path", "unmatched")

    def _check_key(self, path: str, raw_headers: list[tuple[bytes, bytes]]) -> Any:
        """`Authorization: Bearer KEY` (the scheme in any case, RFC 7235) or `X-API-Key: KEY`; any of them may
        hold the key where a client sends several (an OpenAI client sends a Bearer token of its own beside a
        header added for this server; a proxy may add a copy of a header after the client's). The key is
        compared as UTF-8 bytes, so a non-ASCII key matches when the client sends it UTF-8 encoded."""
        if self.api_key is None or path in OPEN_PATHS or path.startswith("/static/"):
            return None
        given, other_scheme = [], False
        for name, value in raw_headers:
            name = name.lower()
            if name == b"authorization":
                # HTTP's whitespace, space and tab: str.strip() would also take 0x85 and 0xA0, bytes of UTF-8
                scheme, _, token = value.decode("latin-1").strip(" \t").partition(" ")
                given.append(token.strip(" \t") if scheme.lower() == "bearer" else "")
                other_scheme = other_scheme or (scheme != "" and scheme.lower() != "bearer")
            elif name == b"x-api-key":
                given.append(value.decode("latin-1"))
        given = [k for k in given if k]
        # Headers were decoded as latin-1, byte for byte: encoding back gives the bytes that were sent.
        key = self.api_key.encode("utf-8")
        if any(hmac.compare_digest(k.encode("latin-1"), key) for k in given):
            return None
        if given:
            message = "invalid API key"
        elif other_scheme:  # a credential of another scheme (Basic ...), or a bare key with no scheme
            message = (
                "missing API key: the Authorization header holds no Bearer token; send Authorization: Bearer <key>"
            )
        else:
            message = "missing API key: send Authorization: Bearer <key>"
        # its body, unread, is read and dropped with a deadline (`server.connections`), the connection kept
        return error_response(
            401, message, headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key" if given else None
        )

    async def _bounded_body(self, headers: dict[str, str], receive: Receive) -> tuple[Receive, Any]:
        """Read the whole body (up to the cap, within `body_timeout`) before the app runs; replay it, then
        pass `receive` on. A body that does not arrive in time is a 408, and the connection is closed (the
        rest of the body may still be on its way)."""
        limit = self.max_body_bytes
        deadline = time.monotonic() + self.body_timeout if math.isfinite(self.body_timeout) else None
        too_big = error_response(413, f"the request body exceeds the limit of {limit} bytes")  # the rest: dropped
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return receive, too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                late = f"the request's body did not arrive within {self.body_timeout:g} s (--body-timeout)"
                return receive, error_response(408, late, headers={"Connection": "close"})
            if message["type"] != "http.request":  # the client left before sending everything: no one reads it
                return receive, error_response(499, GONE)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return receive, too_big
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None


def _framing(headers: dict[str, str]) -> Any:
    """A 400 that closes the connection for a request with both Content-Length and Transfer-Encoding: h11
    reads its body as chunked, a proxy in front may have read it by its length, so where the next request
    starts is in doubt (request smuggling); RFC 9112, section 6.3, says to close the connection after it."""
    if "content-length" in headers and "transfer-encoding" in headers:
        message = "the request has both Content-Length and Transfer-Encoding: send one (RFC 9112, section 6.3)"
        return error_response(400, message, headers={"Connection": "close"})
    return None


def _coding(scope: Scope, headers: dict[str, str]) -> Any:
    """A 415 for a body sent compressed (`Content-Encoding: gzip`): bodies are read as they come, so a gzipped
    one would be a 400 for bytes that are not UTF-8, and plain JSON labelled gzip would be read as if the label
    were not there. RFC 9110, section 15.5.16: say which codings are taken, in Accept-Encoding. The codings of
    every Content-Encoding line count (a list split over lines is one list, section 5.3); a request with no
    body has nothing to decode."""
    if "transfer-encoding" not in headers and headers.get("content-length", "0").strip() in ("", "0"):
        return None
    lines = [value.decode("latin-1") for name, value in scope["headers"] if name.lower() == b"content-encoding"]
    codings = (c.strip().lower() for line in lines for c in line.split(","))
    given = [c for c in codings if c not in ("", "identity")]
    if not given:
        return None
    message = f"the body is sent with Content-Encoding {clip(', '.join(given), str)}: send it uncompressed"
    return error_response(415, message, headers={"Accept-Encoding": "identity"})


class SlicedBodies(HTTPOnly):
    """Plain ASGI: an answer's body goes to the connection in slices of `slice_bytes` (1 MiB), each sent once
    the send buffer has room (uvicorn's flow control). Sent whole, a dump of 147 MB went into the buffer at
    once: the request had finished, its share of the dump budget (`server.routes.deps.DumpBudget`) was given
    back, and a client that read none of it held those bytes outside the budget. Sliced, the request waits
    with its answer until the client has taken all but the last slice, its reservation held meanwhile;
    `--write-timeout` drops a client that takes nothing. Each slice gives the event loop a turn: a send into
    a connection the client has reset fails without waiting, so without one the rest of a large answer went
    into the closed connection in one turn, asyncio logging "socket.send() raised exception." for each slice,
    before uvicorn could learn that the client had gone (after it does, a send is dropped at once)."""

    slice_bytes = 1 << 20

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or len(body) <= self.slice_bytes:
                await send(message)
                return
            view, more = memoryview(body), message.get("more_body", False)
            for start in range(0, len(body), self.slice_bytes):
                piece = bytes(view[start : start + self.slice_bytes])  # bytes, as ASGI has a body
                last = start + self.slice_bytes >= len(body)
                await send({"type": "http.response.body", "body": piece, "more_body": more or not last})
                await asyncio.sleep(0)

        await self.app(scope, receive, sending)
