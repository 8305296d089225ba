"""Connections: how gpt2-serve accepts them and how long a client may hold one without using it.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but it gives a request's headers
no time limit: a client that connects and sends nothing, or half a request line, holds its connection
for ever; and a client that reads none of its answer holds it in the send buffer for ever (a 147 MB dump,
say). `bounded_protocol` is uvicorn's h11 protocol with a deadline for the headers (a 408 in the API's error
shape, then the connection closes), a deadline for a client that leaves its answer unread (the connection
is dropped, its buffer freed) and a cap on open connections (a request on a connection opened when the cap's
worth of others were open already, and still are, is answered 503, `/health` excepted: see `UNCAPPED`). The
body's deadline is the request guard's (`server.middleware`), so that it holds behind Ray Serve's proxy too. A
request h11 cannot parse is answered 400 in the API's error shape too (uvicorn's is plain text). On shutdown,
the requests in flight get `drain_timeout` seconds (`uvicorn_config`)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
import socket
import struct
import sys
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from .errors import error_body
from .metrics import LIFESPAN_KEY
from .middleware import CLOSE, CUT, DRAINING, LEFT, MALFORMED, REFUSAL, app_path, origin_form, request_id_of
from .settings import Settings

log = logging.getLogger(__name__)

# Paths served past the connection cap. A liveness probe opens a new connection each time, so under a flood of
# connections a capped /health would fail it and the orchestrator would restart a pod that serves its clients
# within the cap well. Answering /health costs no more than answering its 503 would: the connection is open
# already either way, the route reads a flag, and the connection closes after it as after the 503.
UNCAPPED = frozenset({"/health"})


def uvicorn_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for `app`, with the connection bounds of `settings`. The protocol and the
    event loop are named (not uvicorn's `auto`), so the server behaves the same whether or not httptools
    and uvloop are installed (Ray brings both)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        http=bounded_protocol(settings.header_timeout, settings.max_connections, settings.write_timeout),
        # no WebSocket protocol (the API has no WebSocket route): an `Upgrade: websocket` request is served as
        # the HTTP request it also is, on this protocol, which counts its connection out when it closes (handed
        # to uvicorn's WebSocket protocol, the connection stayed counted in, forever, one more each attempt)
        ws="none",
        loop="asyncio",
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # typed int; a float works
        # on SIGTERM, the requests in flight get this long, then are cancelled: a bound an orchestrator's grace
        # period can cover (uvicorn's default, None, waits on a stream for as long as it runs)
        timeout_graceful_shutdown=settings.drain_timeout,  # type: ignore[arg-type]  # as above
    )


def bounded_protocol(header_timeout: float, max_connections: int, write_timeout: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with `header_timeout` seconds for each request's headers, `write_timeout` seconds
    for a client to take any of its answer once the send buffer is full, and at most `max_connections` open
    connections."""

    class BoundedH11Protocol(_BoundedH11Protocol):
        pass

    BoundedH11Protocol.header_timeout = header_timeout
    BoundedH11Protocol.max_connections = max_connections
    BoundedH11Protocol.write_timeout = write_timeout
    return BoundedH11Protocol


_ACCEPTED = itertools.count()  # connections in the order they opened, process-wide (`_BoundedH11Protocol._order`)
# What a client must have taken in a write deadline's period, in bytes its TCP acknowledged, to get another: a
# client's TCP acknowledges what its kernel accepts, a segment or so at a time even to one that reads a byte a
# period, which would hold its answer (and its dump's reservation) for ever.
MIN_TAKEN = 64 * 1024


def bytes_acked(sock: Any) -> int | None:
    """The bytes of our answers the client's TCP has acknowledged on `sock` so far (Linux's TCP_INFO,
    `tcpi_bytes_acked`), or None where that cannot be read (another OS, a Unix socket, an old kernel). They
    move as the client's kernel takes them, which it goes on doing only as the client reads (its receive
    buffer full, it takes no more), through our kernel's send buffer (megabytes), which our own buffer only
    sees drain in steps of about half of it."""
    if sock is None or not sys.platform.startswith("linux"):  # the struct below is Linux's
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    offset = 120  # struct tcp_info: 8 bytes of flags, 24 u32 fields, then u64 pacing rates, then bytes_acked
    return struct.unpack_from("Q", info, offset)[0] if len(info) >= offset + 8 else None


def _raw_response(
    status: int, reason: str, body: dict[str, Any], server_headers: list[tuple[bytes, bytes]], request_id: str | None
) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers written past h11 (a request it has
    not seen, or one it could not parse), the connection closed after them, in the form of every other answer:
    the server's own headers (`date`, `server`), the body as the app's JSON responses write it, and
    `request_id` where the request has one (its headers were read)."""
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()  # as Starlette's JSONResponse
    headers = [*server_headers, (b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if request_id:
        headers.append((b"x-request-id", request_id.encode("ascii")))  # printable ASCII (`REQUEST_ID`)
    headers.append((b"connection", b"close"))
    lines = [b"HTTP/1.1 %d %s" % (status, reason.encode("ascii")), *(name + b": " + value for name, value in headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


class _HintingConnection(h11.Connection):
    """h11's server side, keeping the status its last protocol error hints at (`error_status_hint`: 431 for a
    request line and headers longer than its buffer, 501 for a Transfer-Encoding it cannot read, else 400),
    which uvicorn's handler drops, answering 400 to all. h11 measures a head against its buffer only while it
    is incomplete: one that arrives whole in one read, however long, it takes; here that is a 431 too."""

    error_status_hint = 400

    def __init__(self, role: Any, head_limit: int) -> None:
        super().__init__(role, head_limit)
        self.head_limit = head_limit

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _head_bytes(event) > self.head_limit:
                raise h11.RemoteProtocolError("the request line and headers are too long", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as exc:
            self.error_status_hint = exc.error_status_hint
            raise


def _head_bytes(request: h11.Request) -> int:
    """The bytes of a request's line and headers as sent, but for the white space around header values that
    h11 trims: `METHOD target HTTP/1.1`, each `name: value`, each line's CRLF and the blank line's."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


# What a request h11 could not read is told, by the status h11 hints at (`_HintingConnection`).
_UNREADABLE = {
    400: (
        "Bad Request",
        "the request is not valid HTTP/1.1: its request line, headers or body framing could not be read",
    ),
    431: ("Request Header Fields Too Large", "the request line and headers did not end within {limit} bytes"),
    501: (
        "Not Implemented",
        "the request's Transfer-Encoding is not one this server reads: send chunked alone, or a Content-Length",
    ),
}


class _QuieterLog(logging.LoggerAdapter):
    """uvicorn's error log, with its warning for each request h11 cannot parse (one line a request, which any
    client can send as fast as it likes, without its address) said at debug level: `send_400_response` says it
    at info, with the client's address."""

    def __getattr__(self, name: str) -> Any:  # the rest as the logger has it (uvicorn reads its `level`)
        return getattr(self.logger, name)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 2)  # the record names uvicorn's line, not this one
        if msg == INVALID_REQUEST:
            self.debug(msg, *args, **kwargs)
        else:
            super().warning(msg, *args, **kwargs)


INVALID_REQUEST = "Invalid HTTP request received."  # uvicorn's words


class _BoundedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 1024
    write_timeout: float = 30.0

    def _unsupported_upgrade_warning(self) -> None:
        """An `Upgrade` request is served as plain HTTP (`ws="none"`): said at debug level, not as uvicorn's two
        warnings a request (one of them advising a WebSocket library), which any client could flood the log with."""
        log.debug("an Upgrade request from %s, served as plain HTTP (the server speaks no WebSocket)", self.client)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._taken: tuple[int, int | None] = (0, None)  # the write deadline's last look (`_progress`)
        self._dropped = False  # by the write deadline
        self._order = next(_ACCEPTED)
        self.limit_concurrency = None  # the cap is checked below, answered in the API's error shape
        self._app = self.app
        self.app = self._app_or_503
        self.logger = _QuieterLog(self.logger, {})  # type: ignore[assignment]
        limit = self.config.h11_max_incomplete_event_size  # as uvicorn sizes its connection's buffer
        self._head_limit = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit
        self.conn = self._hinting = _HintingConnection(h11.SERVER, self._head_limit)

    def shutdown(self) -> None:
        """uvicorn's start of a graceful shutdown; the request in flight is marked, so that the guard tells its
        cancellation at the end of the drain from a client's leaving (`DRAINING`)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope[DRAINING] = True  # type: ignore[literal-required]  # our key in the ASGI scope
        super().shutdown()

    # The headers' deadline starts when the connection opens, and again when the first bytes of a next
    # request arrive on a kept-alive connection (until then it is idle, and the keep-alive timeout applies),
    # or are there already when an answer ends (a client that pipelines).

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened().append(self._order)  # orders only grow: the list stays sorted
        self._watch_headers()

    def _opened(self) -> list[int]:
        """The orders of this server's open connections, sorted (kept on uvicorn's state for the server)."""
        opened: list[int] | None = getattr(self.server_state, "gpt2_opened", None)
        if opened is None:
            opened = self.server_state.gpt2_opened = []  # type: ignore[attr-defined]
        return opened

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        idle = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
        if idle and not self.conn.trailing_data[0] and not self.transport.is_closing():
            # the rest of a refused request's body came (`_drain_body`), and nothing after it: the connection is
            # idle, as after an answer, so the keep-alive timeout applies (the headers' would send a 408 to a
            # client about to reuse the connection)
            self._stop_header_timer()
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:  # its answer cut (`CUT`)
            cycle.scope[CUT] = "write_timeout" if self._dropped else "client_left"  # type: ignore[literal-required]
        elif cycle is not None and not cycle.response_complete:  # gone before its answer began (`LEFT`)
            cycle.scope[LEFT] = True  # type: ignore[literal-required]  # our key in the ASGI scope
        self._stop_header_timer()
        self._stop_write_timer()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        opened = self._opened()
        at = bisect.bisect_left(opened, self._order)
        if at < len(opened) and opened[at] == self._order:
            del opened[at]
        super().connection_lost(exc)

    # An answer given before the request's body was read (a 401, a 413): uvicorn reads the rest of the body and
    # drops it, then serves the next request on the connection. Closing at once instead would reset it, the body
    # unread, and a client still sending would see the reset, not the answer; reading it with no deadline let a
    # client that trickled a declared terabyte hold the connection for ever (each byte restarts the keep-alive
    # timeout). So the rest of the body gets `header_timeout`, as the next request's headers would.

    def _drain_body(self) -> None:
        draining = self.cycle

        def too_slow() -> None:
            self._drain_timer = None
            if self.cycle is draining and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                log.info(
                    "the rest of a refused request's body did not arrive within %g s; closing the connection from %s",
                    self.header_timeout,
                    self.client,
                )
                self.transport.close()

        self._drain_timer = self.loop.call_later(self.header_timeout, too_slow)

    # The send buffer is full (asyncio's high-water mark): the answer waits there, and the app, whose sends
    # wait for room (uvicorn's flow control), with it. Each `write_timeout` while it stays full, the client must
    # have taken something (`_progress`: its TCP acknowledged more bytes, or the buffer is smaller than at the
    # last look): a slow reader goes on, one that takes nothing is dropped.

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stop_write_timer()  # a period from now, from what the client has taken now
        self._watch_writes()

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # an answer's tail can sit in the buffer under the high-water mark, never pausing the writes: its
        # deadline too (the connection would otherwise wait for it for ever, closing or kept alive)
        if self._write_timer is None and self.transport.get_write_buffer_size():
            self._watch_writes()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:  # answered before its body was read: the rest has a deadline
            self._drain_body()
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            # part of the next request came with this one: not idle (uvicorn's keep-alive timeout would close it
            # without a word), its headers' deadline runs
            self._unset_keepalive_if_required()
            self._watch_headers()

    def _progress(self) -> tuple[int, int | None]:
        """What the client has taken, as far as it shows: the bytes still in our send buffer, and the bytes
        its TCP has acknowledged (`bytes_acked`; None where unknown)."""
        return self.transport.get_write_buffer_size(), bytes_acked(self.transport.get_extra_info("socket"))

    def _watch_writes(self) -> None:
        self._taken = self._progress()
        self._write_timer = self.loop.call_later(self.write_timeout, self._check_writes)

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _check_writes(self) -> None:
        self._write_timer = None
        (buffered, acked), (before, acked_before) = self._progress(), self._taken
        if buffered == 0:  # all taken
            return
        if buffered < before or (acked is not None and acked_before is not None and acked - acked_before >= MIN_TAKEN):
            self._watch_writes()  # the client took some: another period
            return
        log.info(
            "the client at %s took none of its answer in %g s (--write-timeout): dropping the connection",
            self.client,
            self.write_timeout,
        )
        self._dropped = True
        self.transport.abort()  # its buffer goes, unsent; the app's waiting sends return (the client is gone)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad chunk size, two Content-Lengths that differ, no Host): uvicorn's
        answer, 400 and the connection closed, in the API's error shape rather than plain text; where no route
        saw the request, with the status h11 hints at (431 for a request line and headers over h11's buffer,
        501 for a Transfer-Encoding other than chunked), which uvicorn's answer drops. Where its headers were
        read and its body could not be (a bad chunk), the request's guard counts and logs it as a 400
        (`MALFORMED`), and the answer carries its request id; else it is logged here."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer has begun: no other can be sent
            self.transport.close()
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        request_id = request_id_of(cycle.scope) if cycle is not None else None  # type: ignore[arg-type]  # a dict
        status = 400
        if cycle is not None:
            cycle.scope[MALFORMED] = True  # type: ignore[literal-required]  # our key in the ASGI scope
        else:
            status = self._hinting.error_status_hint
            status = status if status in _UNREADABLE else 400
            log.info("a request from %s could not be read as HTTP/1.1: answered %d, closing", self.client, status)
            self._count_unseen(status)
        reason, message = _UNREADABLE[status]
        answer = error_body(status, message.format(limit=self._head_limit))
        self.transport.write(_raw_response(status, reason, answer, self.server_state.default_headers, request_id))
        self.transport.close()  # h11 is done with the connection

    def _watch_headers(self) -> None:
        """Waiting for a request's headers (h11's client side is IDLE until they are complete): the timer
        runs; otherwise it stops."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        elif not waiting:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request's headers did not arrive within {self.header_timeout:g} s (--header-timeout)"
        log.info("%s; closing the connection from %s", message, self.client)
        if self.conn.trailing_data[0]:  # part of a request came (a connection opened and left unused is no request)
            self._count_unseen(408)
        # h11 cannot send a response to a request it has not seen: the bytes are written as they are.
        answer = error_body(408, message)
        self.transport.write(_raw_response(408, "Request Timeout", answer, self.server_state.default_headers, None))
        self.transport.close()

    def _count_unseen(self, status: int) -> None:
        """Count in /metrics an answer to a request no route saw (its request line or headers could not be
        read), under `unmatched`, as the guard counts a path no route has."""
        metrics = self.app_state.get(LIFESPAN_KEY)  # the app's, from its lifespan
        if metrics is not None:
            metrics.requests.labels(route="unmatched", status=str(status)).inc()

    async def _app_or_503(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request on a connection that is not among the first `max_connections` of those open now, in the
        order they opened, is refused: a client that keeps a connection within the cap is served however many
        open after it (idle ones, say, which the header deadline closes), and a newer connection is served once
        older ones have closed. The request guard answers it: a 503 with a request id, logged and counted like
        every other answer. `UNCAPPED` paths are served whatever the count, and their connection then closes."""
        older = 0 if len(self.connections) <= self.max_connections else bisect.bisect_left(self._opened(), self._order)
        origin_form(scope)  # `GET http://host/health` is /health (the guard would take it so, after this check)
        if older >= self.max_connections and app_path(scope) in UNCAPPED:
            scope[CLOSE] = True
        elif older >= self.max_connections:
            scope[REFUSAL] = (
                f"the server's {self.max_connections} connections (its limit, --max-connections) are taken by "
                f"{older} opened before this one"
            )
        await self._app(scope, receive, self._unless_closing(send))
        cycle = self.cycle
        if scope.get(CUT) == "drain" and cycle is not None and cycle.scope is scope and not cycle.response_complete:
            # an answer the shutdown cut at the end of its drain (the guard logged it so): its connection closes,
            # without its end, as uvicorn would close it, but without uvicorn's error "ASGI callable returned
            # without completing response"
            cycle.disconnected = True
            self.transport.close()

    def _unless_closing(self, send: Send) -> Send:
        """`send`, less the pieces of an answer's body (all but the last) sent while its connection closes. A
        client that resets the connection fails the next write, or the next read, and asyncio closes the
        transport, but uvicorn learns it (`connection_lost`) only in a later turn of the event loop; until then
        it writes each piece sent into the closed transport, and asyncio logs "socket.send() raised exception."
        for each from the fifth on (a stream's events of several decode steps go out in one turn where the loop
        was busy). Dropped here, as uvicorn drops them once it knows. The last goes on: it marks the answer
        complete (without it, an answer ready in the turn its client left ends with uvicorn's error "ASGI
        callable returned without completing response"), one more write into the closed transport."""

        async def sending(message: Message) -> None:
            closing = message["type"] == "http.response.body" and self.transport.is_closing()
            if closing and message.get("more_body", False):
                return
            await send(message)

        return sending
